"""Checks of the idem binary shared by the Python end-to-end tests."""

import subprocess


def fails_in_one_line(idem, args, *needles, env=None, secret=None):
    """Runs `idem ARGS`, which must exit 1 with one line on stderr holding every needle (and
    never `secret`); returns that line."""
    done = subprocess.run([idem, *args], capture_output=True, text=True, env=env)
    assert done.returncode == 1, f"{args}: exit {done.returncode}\n{done.stderr}"
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, f"{args}: not one line:\n{done.stderr}"
    for needle in needles:
        assert needle in lines[0], f"{args}: {needle!r} not in {lines[0]!r}"
    assert secret is None or secret not in done.stdout + done.stderr, f"{args}: the secret was printed"
    return lines[0]
