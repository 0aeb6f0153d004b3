//! How the binary prints an error: once, and never longer than a screen.
//!
//! Library errors already put their cause into their own message (`read failed: {0}`), and
//! anyhow's alternate form appends every source again, so a plain `{error:#}` printed the same
//! text two or three times. [`render`] walks the chain and leaves out a cause whose text is
//! already there. Errors about user input may quote it (serde names the bad value), so the result
//! is cut to [`MAX_ERROR_CHARS`].

/// Longest error message printed, in characters; the rest is counted, not echoed.
pub const MAX_ERROR_CHARS: usize = 1024;

/// `error`'s chain as one line, each cause once, at most [`MAX_ERROR_CHARS`] characters.
pub fn render(error: &anyhow::Error) -> String {
    let mut text = String::new();
    for cause in error.chain() {
        let message = cause.to_string();
        if text.contains(&message) {
            continue;
        }
        if !text.is_empty() {
            text.push_str(": ");
        }
        text.push_str(&message);
    }
    cut(&text)
}

/// `text` cut to [`MAX_ERROR_CHARS`] characters, saying how much was left out.
pub fn cut(text: &str) -> String {
    match text.char_indices().nth(MAX_ERROR_CHARS) {
        None => text.to_string(),
        Some((end, _)) => format!("{}... ({} more bytes not shown)", &text[..end], text.len() - end),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("dcp must be at least 1, got 0")]
    struct Leaf;

    #[derive(Debug, thiserror::Error)]
    #[error("invalid group: {0}")]
    struct Wrapper(#[source] Leaf);

    #[test]
    fn each_cause_is_printed_once() {
        let error = anyhow::Error::new(Wrapper(Leaf)).context("scenario.json: invalid scenario");
        assert_eq!(
            render(&error),
            "scenario.json: invalid scenario: invalid group: dcp must be at least 1, got 0"
        );
        let error = anyhow::Error::new(Leaf).context("loading");
        assert_eq!(render(&error), "loading: dcp must be at least 1, got 0");
    }

    #[test]
    fn long_messages_are_cut_with_a_count() {
        let long = "x".repeat(100_000);
        let error = anyhow::anyhow!("unknown variant `{long}`");
        let text = render(&error);
        let full = format!("unknown variant `{long}`");
        let left_out = full.len() - MAX_ERROR_CHARS;
        assert_eq!(
            text,
            format!(
                "{}... ({left_out} more bytes not shown)",
                &full[..MAX_ERROR_CHARS]
            )
        );
        assert_eq!(cut("short"), "short");
        // Multi-byte characters are never split.
        let wide = "é".repeat(2000);
        assert!(cut(&wide).starts_with(&"é".repeat(MAX_ERROR_CHARS)));
    }
}
