//! Durations as operators write them on command lines: `7d`, `36h`, `0s`.

use std::time::Duration;

use crate::error::{Error, Result};

/// Parses a duration: a number and a unit, `s`, `m`, `h`, `d` or `w` (`7d`, `36h`, `0s`).
///
/// # Errors
/// Anything else.
pub fn parse_duration(text: &str) -> Result<Duration> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let seconds = match unit.trim() {
        "s" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86_400,
        "w" => 7 * 86_400,
        _ => 0,
    };
    match number.parse::<u64>() {
        Ok(n) if seconds > 0 => Ok(Duration::from_secs(n.saturating_mul(seconds))),
        _ => Err(Error::InvalidArgument(format!(
            "bad duration '{text}': use a number and s, m, h, d or w (e.g. 7d)"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse_with_units_and_refuse_the_rest() {
        assert_eq!(
            parse_duration("7d").ok(),
            Some(Duration::from_secs(604_800))
        );
        assert_eq!(
            parse_duration("36h").ok(),
            Some(Duration::from_secs(129_600))
        );
        assert_eq!(parse_duration("0s").ok(), Some(Duration::ZERO));
        assert_eq!(
            parse_duration("2w").ok(),
            Some(Duration::from_secs(1_209_600))
        );
        for bad in ["", "7", "d", "7x", "-1d", "1.5h"] {
            assert!(parse_duration(bad).is_err(), "{bad}");
        }
    }
}
