//! Text tables: aligned plain text for the terminal, markdown for the docs.

/// The widest line a plain table should take (a terminal's width, less a
/// little).
pub const MAX_WIDTH: usize = 100;

/// A table of text cells under a header.
pub struct Table {
    header: Vec<String>,
    rows: Vec<Vec<String>>,
}

impl Table {
    /// An empty table with these column names.
    pub fn new<S: Into<String>>(header: impl IntoIterator<Item = S>) -> Table {
        Table {
            header: header.into_iter().map(Into::into).collect(),
            rows: Vec::new(),
        }
    }

    /// Appends a row (as many cells as columns).
    pub fn row<S: Into<String>>(&mut self, cells: impl IntoIterator<Item = S>) {
        let row: Vec<String> = cells.into_iter().map(Into::into).collect();
        debug_assert_eq!(row.len(), self.header.len(), "{row:?}");
        self.rows.push(row);
    }

    /// Removes the columns whose every cell is a zero number, returning
    /// their names.
    pub fn drop_zero_columns(&mut self) -> Vec<String> {
        let zero = |cell: &String| cell.parse::<f64>().is_ok_and(|v| v == 0.0);
        let keep: Vec<bool> = (0..self.header.len())
            .map(|c| self.rows.is_empty() || !self.rows.iter().all(|r| zero(&r[c])))
            .collect();
        let dropped = self
            .header
            .iter()
            .zip(&keep)
            .filter(|(_, k)| !**k)
            .map(|(h, _)| h.clone())
            .collect();
        let retain = |cells: &mut Vec<String>| {
            let mut c = 0;
            cells.retain(|_| {
                c += 1;
                keep[c - 1]
            });
        };
        retain(&mut self.header);
        self.rows.iter_mut().for_each(retain);
        dropped
    }

    /// Aligned columns two spaces apart, the first left-aligned, the others
    /// right-aligned. Where that is wider than [`MAX_WIDTH`], a column name
    /// wider than every cell under it breaks after a hyphen (`size-` over
    /// `class`), and then, if still needed, columns are one space apart.
    pub fn plain(&self) -> String {
        let fits = |text: &String| text.lines().all(|l| l.chars().count() <= MAX_WIDTH);
        let mut text = String::new();
        for (break_names, gap) in [(false, "  "), (true, "  "), (true, " ")] {
            text = self.aligned(break_names, gap);
            if fits(&text) {
                break;
            }
        }
        text
    }

    fn aligned(&self, break_names: bool, gap: &str) -> String {
        let cell_width = |c: usize| self.rows.iter().map(|r| r[c].chars().count()).max();
        let names: Vec<(String, String)> = self
            .header
            .iter()
            .enumerate()
            .map(|(c, name)| match name.split_once('-') {
                Some((first, rest))
                    if break_names && cell_width(c).is_some_and(|w| w < name.len()) =>
                {
                    (format!("{first}-"), rest.to_string())
                }
                _ => (String::new(), name.clone()),
            })
            .collect();
        let mut header: Vec<Vec<String>> = Vec::new();
        if names.iter().any(|(first, _)| !first.is_empty()) {
            header.push(names.iter().map(|(first, _)| first.clone()).collect());
        }
        header.push(names.into_iter().map(|(_, last)| last).collect());
        let widths: Vec<usize> = (0..self.header.len())
            .map(|c| {
                header
                    .iter()
                    .chain(&self.rows)
                    .map(|r| r[c].chars().count())
                    .max()
                    .unwrap_or(0)
            })
            .collect();
        let mut out = String::new();
        for row in header.iter().chain(&self.rows) {
            let cells: Vec<String> = row
                .iter()
                .zip(&widths)
                .enumerate()
                .map(|(c, (cell, &w))| {
                    if c == 0 {
                        format!("{cell:<w$}")
                    } else {
                        format!("{cell:>w$}")
                    }
                })
                .collect();
            out.push_str(cells.join(gap).trim_end());
            out.push('\n');
        }
        out
    }

    /// A markdown table, numbers right-aligned.
    pub fn markdown(&self) -> String {
        let line = |cells: &[String]| format!("| {} |\n", cells.join(" | "));
        let rule: Vec<String> = (0..self.header.len())
            .map(|c| if c < 2 { "---" } else { "---:" }.to_string())
            .collect();
        let mut out = line(&self.header);
        out.push_str(&line(&rule));
        for row in &self.rows {
            out.push_str(&line(row));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Table {
        let mut t = Table::new(["trace", "peak", "waits", "x"]);
        t.row(["a", "1.00 GiB", "0", "1.5"]);
        t.row(["long name", "12.00 GiB", "0.000", ""]);
        t
    }

    #[test]
    fn zero_columns_go_and_are_named() {
        let mut t = sample();
        assert_eq!(t.drop_zero_columns(), ["waits"]);
        assert_eq!(t.header, ["trace", "peak", "x"]);
        assert_eq!(t.rows[1], ["long name", "12.00 GiB", ""]);
    }

    #[test]
    fn a_name_wider_than_its_numbers_breaks_after_its_hyphen() {
        let mut t = Table::new(["trace", "size-class", "x-long-number"]);
        t.row(["a", "1.000", "123456789012345"]);
        assert_eq!(
            t.plain().lines().next(),
            Some("trace  size-class    x-long-number")
        );
        // Too wide: the name goes on two lines.
        let long = "9".repeat(MAX_WIDTH - 14);
        t.row(["b", "2.000", &long]);
        let plain = t.plain();
        let lines: Vec<&str> = plain.lines().collect();
        assert_eq!(lines[0], "       size-");
        assert!(lines[1].starts_with("trace  class  "), "{plain}");
        assert!(lines[1].ends_with("  x-long-number"), "{plain}");
        assert!(lines[2].starts_with("a      1.000  "), "{plain}");
        assert!(lines.iter().all(|l| l.len() <= MAX_WIDTH), "{plain}");
        // Still too wide: one space between columns.
        t.row(["c", "3.000", &format!("{long}9")]);
        let plain = t.plain();
        assert!(
            plain.lines().nth(1).unwrap().starts_with("trace class "),
            "{plain}"
        );
        assert!(plain.lines().all(|l| l.len() <= MAX_WIDTH), "{plain}");
    }

    #[test]
    fn plain_text_aligns_and_markdown_has_a_rule() {
        let t = sample();
        let plain = t.plain();
        let lines: Vec<&str> = plain.lines().collect();
        assert_eq!(lines[1], "a           1.00 GiB      0  1.5");
        assert_eq!(lines[2], "long name  12.00 GiB  0.000");
        let md = t.markdown();
        assert!(
            md.starts_with("| trace | peak | waits | x |\n| --- | --- | ---: | ---: |\n"),
            "{md}"
        );
    }
}
