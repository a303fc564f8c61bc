//! "Did you mean": the known word closest to a misspelt one.

/// Edit distance (insertions, deletions, substitutions) between `a` and
/// `b`, by characters; one row of the table at a time.
pub fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut diagonal = row[0];
        row[0] = i + 1;
        for (j, &cb) in b.iter().enumerate() {
            let above = row[j + 1];
            row[j + 1] = (diagonal + usize::from(ca != cb))
                .min(above + 1)
                .min(row[j] + 1);
            diagonal = above;
        }
    }
    row[b.len()]
}

/// The candidate closest to `word`, if one is close enough to be what was
/// meant: at most a third of its characters (and at least one) edited. Case
/// is ignored; the earliest candidate wins a tie.
pub fn closest<'a>(word: &str, candidates: impl IntoIterator<Item = &'a str>) -> Option<&'a str> {
    // A word far longer than any option is not a typo of one; skipping it
    // keeps the distance table small whatever the input's size.
    const LONGEST: usize = 64;
    if word.len() > LONGEST {
        return None;
    }
    let word = word.to_ascii_lowercase();
    let mut best: Option<(usize, &'a str)> = None;
    for candidate in candidates {
        let limit = (candidate.chars().count() / 3).max(1);
        let d = edit_distance(&word, &candidate.to_ascii_lowercase());
        if d <= limit && best.is_none_or(|(b, _)| d < b) {
            best = Some((d, candidate));
        }
    }
    best.map(|(_, c)| c)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn distance_counts_single_edits() {
        assert_eq!(edit_distance("", ""), 0);
        assert_eq!(edit_distance("bound", "bound"), 0);
        assert_eq!(edit_distance("bund", "bound"), 1);
        assert_eq!(edit_distance("bounds", "bound"), 1);
        assert_eq!(edit_distance("buond", "bound"), 2);
        assert_eq!(edit_distance("abc", ""), 3);
        assert_eq!(edit_distance("kitten", "sitting"), 3);
    }

    #[test]
    fn closest_takes_near_words_only() {
        let keys = ["max_split_size_mb", "expandable_segments", "policy"];
        assert_eq!(
            closest("max_split_size", keys),
            Some("max_split_size_mb"),
            "three letters short of seventeen"
        );
        assert_eq!(
            closest("expandable_segment", keys),
            Some("expandable_segments")
        );
        assert_eq!(closest("Policy", keys), Some("policy"));
        assert_eq!(closest("polcy", keys), Some("policy"));
        assert_eq!(closest("banana", keys), None);
        assert_eq!(closest(&"x".repeat(100_000), keys), None);
    }
}
