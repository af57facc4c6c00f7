//! Quantities as operators write and read them: durations (`7d`, `36h`, `0s`), byte sizes
//! (`2GiB`, `512MB`), counts with thousands separators, and the clock in milliseconds.

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

/// Parses a byte size: a number with an optional unit, binary (KiB, MiB, GiB, TiB) or
/// decimal (KB, MB, GB, TB; K, M, G, T), e.g. `2GiB`, `512MiB`, `1.5G`.
///
/// # Errors
/// Anything else, and sizes below one byte.
pub fn parse_size(text: &str) -> Result<u64> {
    let text = text.trim();
    let split = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let number: f64 = number.parse().map_err(|_| {
        Error::InvalidArgument(format!("'{text}' is not a size (e.g. 2GiB, 512MiB, 1G)"))
    })?;
    let scale: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" => 1_000,
        "m" | "mb" => 1_000_000,
        "g" | "gb" => 1_000_000_000,
        "t" | "tb" => 1_000_000_000_000,
        "kib" => 1 << 10,
        "mib" => 1 << 20,
        "gib" => 1 << 30,
        "tib" => 1 << 40,
        other => {
            return Err(Error::InvalidArgument(format!(
                "unknown size unit '{other}' (KiB, MiB, GiB, KB, MB, GB)"
            )));
        }
    };
    let bytes = number * scale as f64;
    if !(1.0..=u64::MAX as f64).contains(&bytes) {
        return Err(Error::InvalidArgument(format!(
            "'{text}' is not a usable size"
        )));
    }
    Ok(bytes as u64)
}

/// `n` with a comma between each group of three digits: `1,234,567`.
pub fn thousands(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// Milliseconds since the Unix epoch.
pub(crate) fn now_millis() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
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

    #[test]
    fn sizes_parse_in_binary_and_decimal_units() {
        assert_eq!(parse_size("2GiB").ok(), Some(2 << 30));
        assert_eq!(parse_size("256MiB").ok(), Some(256 << 20));
        assert_eq!(parse_size("1.5G").ok(), Some(1_500_000_000));
        assert_eq!(parse_size("100000").ok(), Some(100_000));
        assert_eq!(parse_size(" 64 kb ").ok(), Some(64_000));
        assert!(parse_size("lots").is_err());
        assert!(parse_size("5 parsecs").is_err());
        assert!(parse_size("0").is_err());
    }

    #[test]
    fn counts_get_a_separator_every_three_digits() {
        assert_eq!(thousands(0), "0");
        assert_eq!(thousands(999), "999");
        assert_eq!(thousands(1_000), "1,000");
        assert_eq!(thousands(12_345_678), "12,345,678");
    }
}
