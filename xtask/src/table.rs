//! Text tables: aligned plain text for the terminal, markdown for the docs.

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

    /// Aligned columns, the first left-aligned, the others right-aligned.
    pub fn plain(&self) -> String {
        let widths: Vec<usize> = (0..self.header.len())
            .map(|c| {
                std::iter::once(&self.header)
                    .chain(&self.rows)
                    .map(|r| r[c].chars().count())
                    .max()
                    .unwrap_or(0)
            })
            .collect();
        let mut out = String::new();
        for row in std::iter::once(&self.header).chain(&self.rows) {
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
            out.push_str(cells.join("  ").trim_end());
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
