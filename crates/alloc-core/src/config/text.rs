//! What a configuration string may contain, and how much of one an error
//! message quotes.

/// Characters of the input that an error message quotes at most: a
/// configuration of a megabyte must not come back whole on stderr.
pub const EXCERPT_CHARS: usize = 48;

/// `text` as an error message quotes it: whole when short, otherwise its
/// first [`EXCERPT_CHARS`] characters, an ellipsis and its length.
///
/// ```
/// use alloc_core::config::excerpt;
///
/// assert_eq!(excerpt("policy"), "policy");
/// let long = "x".repeat(1 << 20);
/// assert_eq!(excerpt(&long), format!("{}... (1048576 bytes)", "x".repeat(48)));
/// ```
pub fn excerpt(text: &str) -> String {
    match text.char_indices().nth(EXCERPT_CHARS) {
        None => text.to_string(),
        Some((cut, _)) => format!("{}... ({} bytes)", &text[..cut], text.len()),
    }
}

/// Why `text` cannot be a configuration at all, if it cannot: a NUL byte
/// (C and the environment end a string there, so what follows would be
/// silently dropped on the way) or another control character.
pub fn unusable_character(text: &str) -> Option<String> {
    let (at, c) = text
        .char_indices()
        .find(|&(_, c)| c.is_control() && !c.is_whitespace())?;
    Some(if c == '\0' {
        format!("a NUL byte at offset {at}: C strings and the environment end there")
    } else {
        format!("the control character {c:?} at offset {at}")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn excerpts_are_short_and_cut_at_characters() {
        assert_eq!(excerpt(""), "");
        let exact = "y".repeat(EXCERPT_CHARS);
        assert_eq!(excerpt(&exact), exact);
        // Multi-byte characters are never split.
        let wide = "é".repeat(1000);
        let e = excerpt(&wide);
        assert!(e.starts_with(&"é".repeat(EXCERPT_CHARS)), "{e}");
        assert!(e.ends_with("... (2000 bytes)"), "{e}");
        assert!(excerpt(&"z".repeat(1 << 20)).len() < 80);
    }

    #[test]
    fn nul_and_control_characters_are_unusable() {
        let e = unusable_character("max_split_size_mb:64\0garbage").unwrap();
        assert!(e.contains("NUL byte at offset 20"), "{e}");
        assert!(unusable_character("a\u{1b}b").unwrap().contains("offset 1"));
        assert_eq!(
            unusable_character("policy:buddy,\n\texpandable_segments:True"),
            None
        );
    }
}
