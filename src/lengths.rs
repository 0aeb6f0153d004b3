//! `--lengths SPEC`: prompt lengths for `pdkv sweep`, as comma-separated lengths and ranges.

use std::ops::RangeInclusive;

/// Most prompt lengths one spec may name in all (8 MB of lengths).
pub const MAX_LENGTHS: u64 = 1_000_000;

/// Parses `SPEC`: comma-separated lengths and inclusive-exclusive ranges `a..b` (or `a..=b`),
/// at most [`MAX_LENGTHS`] lengths in all.
pub fn parse_lengths(spec: &str) -> Result<Vec<u64>, String> {
    let mut lengths = Vec::new();
    let too_many = || format!("the spec names more than {MAX_LENGTHS} lengths in all");
    for part in spec.split(',').map(str::trim).filter(|part| !part.is_empty()) {
        let range: Option<RangeInclusive<u64>> = if let Some((a, b)) = part.split_once("..=") {
            Some(parse_one(a)?..=parse_one(b)?)
        } else if let Some((a, b)) = part.split_once("..") {
            let (a, b) = (parse_one(a)?, parse_one(b)?);
            if b <= a {
                return Err(format!("range {part:?} is empty"));
            }
            Some(a..=b - 1)
        } else {
            None
        };
        match range {
            Some(range) => {
                if range.is_empty() {
                    return Err(format!("range {part:?} is empty"));
                }
                // The whole u64 range holds 2^64 lengths: one more than u64 counts.
                let count = (range.end() - range.start()).saturating_add(1);
                if count > MAX_LENGTHS - lengths.len() as u64 {
                    return Err(too_many());
                }
                lengths.extend(range);
            }
            None => {
                if lengths.len() as u64 >= MAX_LENGTHS {
                    return Err(too_many());
                }
                lengths.push(parse_one(part)?);
            }
        }
    }
    if lengths.is_empty() {
        return Err("no prompt lengths given".into());
    }
    if let Some(zero) = lengths.iter().position(|&n| n == 0) {
        return Err(format!(
            "prompt length 0 at entry {zero}: lengths must be at least 1"
        ));
    }
    Ok(lengths)
}

fn parse_one(text: &str) -> Result<u64, String> {
    text.trim()
        .parse()
        .map_err(|_| format!("{text:?} is not a prompt length (a whole number)"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn length_specs_parse_and_bad_ones_are_named() {
        assert_eq!(parse_lengths("251,377,440").unwrap(), vec![251, 377, 440]);
        assert_eq!(parse_lengths("1..4").unwrap(), vec![1, 2, 3]);
        assert_eq!(parse_lengths("1..=3, 9").unwrap(), vec![1, 2, 3, 9]);
        assert_eq!(parse_lengths("5..5").unwrap_err(), "range \"5..5\" is empty");
        assert_eq!(
            parse_lengths("x").unwrap_err(),
            "\"x\" is not a prompt length (a whole number)"
        );
        assert_eq!(
            parse_lengths("0,1").unwrap_err(),
            "prompt length 0 at entry 0: lengths must be at least 1"
        );
        assert_eq!(parse_lengths("").unwrap_err(), "no prompt lengths given");
        assert_eq!(
            parse_lengths("18446744073709551616").unwrap_err(),
            "\"18446744073709551616\" is not a prompt length (a whole number)"
        );
        assert_eq!(parse_lengths("1..1000001").unwrap().len(), 1_000_000);
        // Every u64: the count itself does not fit a u64.
        assert_eq!(
            parse_lengths("0..=18446744073709551615").unwrap_err(),
            "the spec names more than 1000000 lengths in all"
        );
        assert_eq!(
            parse_lengths("1..1000002").unwrap_err(),
            "the spec names more than 1000000 lengths in all"
        );
        // The cap is on the total, not per range.
        let many = vec!["1..1000"; 1002].join(",");
        assert_eq!(
            parse_lengths(&many).unwrap_err(),
            "the spec names more than 1000000 lengths in all"
        );
        let singles = vec!["7"; 1_000_001].join(",");
        assert_eq!(
            parse_lengths(&singles).unwrap_err(),
            "the spec names more than 1000000 lengths in all"
        );
    }
}
