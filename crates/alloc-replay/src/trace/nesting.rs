//! How deeply a pickle nests its containers, found before it is decoded.
//!
//! The pickle decoder builds and drops values recursively, once per level of
//! nesting: a crafted pickle of a few hundred kilobytes (lists inside lists,
//! 100,000 deep) would overflow the thread's stack and abort the whole process,
//! Python's included when the library is called from it. PyTorch's snapshots nest
//! a handful of levels. This pass runs the pickle machine on depths alone: every
//! object on its stack or in its memo is a depth, a container is one deeper than
//! the deepest thing put into it. What the pass cannot follow (a truncated
//! stream, an unknown opcode, a stack underflow) it leaves to the decoder, which
//! reports it.

use std::collections::HashMap;

/// The deepest nesting accepted: far above any snapshot, far below what
/// overflows a 2 MiB thread stack.
pub(crate) const MAX_DEPTH: u32 = 200;

/// An entry of the machine's stack.
#[derive(Clone, Copy)]
enum Item {
    /// An object: index into [`Machine::depths`].
    Object(usize),
    /// A `MARK`.
    Mark,
}

struct Machine<'a> {
    bytes: &'a [u8],
    pos: usize,
    /// Depth of every object made so far (scalars 0, an empty container 1).
    depths: Vec<u32>,
    /// Whether the object was put into a container: it must not get deeper
    /// afterwards, or the container's depth would be stale.
    contained: Vec<bool>,
    stack: Vec<Item>,
    memo: HashMap<u64, usize>,
    max: u32,
}

/// Why the pass stopped early.
enum Stop {
    /// Too deep, or deepened after it was placed in a container.
    Refused(String),
    /// What the decoder will report (truncation, unknown opcode, underflow).
    LeftToDecoder,
}

/// `Err` with the reason when `bytes` nest containers deeper than `max`
/// levels; `Ok` otherwise, and for what the decoder reports itself.
pub(crate) fn check(bytes: &[u8], max: u32) -> Result<(), String> {
    let mut m = Machine {
        bytes,
        pos: 0,
        depths: Vec::new(),
        contained: Vec::new(),
        stack: Vec::new(),
        memo: HashMap::new(),
        max,
    };
    match m.run() {
        Ok(()) | Err(Stop::LeftToDecoder) => Ok(()),
        Err(Stop::Refused(reason)) => Err(reason),
    }
}

impl Machine<'_> {
    fn run(&mut self) -> Result<(), Stop> {
        loop {
            let op = self.take(1)?[0];
            match op {
                b'.' => return Ok(()),
                // Scalars with a fixed-size argument, or none.
                b'N' | 0x88 | 0x89 | 0x97 => self.scalar(0)?,
                b'K' | 0x82 => self.scalar(1)?,
                b'M' | 0x83 => self.scalar(2)?,
                b'J' | 0x84 => self.scalar(4)?,
                b'G' => self.scalar(8)?,
                // Scalars with a length-prefixed argument.
                0x8a | b'U' | b'C' | 0x8c => self.sized_scalar(1)?,
                0x8b | b'T' | b'X' | b'B' => self.sized_scalar(4)?,
                0x8d | 0x8e | 0x96 => self.sized_scalar(8)?,
                // Scalars with newline-terminated arguments.
                b'I' | b'L' | b'F' | b'S' | b'V' | b'P' => {
                    self.line()?;
                    self.push_new(0);
                }
                b'c' => {
                    self.line()?;
                    self.line()?;
                    self.push_new(0);
                }
                0x93 | b'Q' => {
                    let n = if op == 0x93 { 2 } else { 1 };
                    for _ in 0..n {
                        self.pop()?;
                    }
                    self.push_new(0);
                }
                // Frames, the protocol and read-only buffers change nothing.
                0x80 => drop(self.take(1)?),
                0x95 => drop(self.take(8)?),
                0x98 => {}
                // Empty containers.
                b']' | b'}' | b')' | 0x8f => self.push_new(1),
                b'(' => self.stack.push(Item::Mark),
                // Into the container below.
                b'a' => {
                    let v = self.pop()?;
                    self.put_into_top(&[v])?;
                }
                b's' => {
                    let v = self.pop()?;
                    let k = self.pop()?;
                    self.put_into_top(&[k, v])?;
                }
                b'b' => {
                    let state = self.pop()?;
                    self.put_into_top(&[state])?;
                }
                b'e' | b'u' | 0x90 => {
                    let items = self.pop_to_mark()?;
                    self.put_into_top(&items)?;
                }
                // New containers (or objects) made of what they pop.
                b'l' | b't' | b'd' | 0x91 | b'o' => {
                    let items = self.pop_to_mark()?;
                    self.push_made_of(&items)?;
                }
                b'i' => {
                    self.line()?;
                    self.line()?;
                    let items = self.pop_to_mark()?;
                    self.push_made_of(&items)?;
                }
                0x85..=0x87 => {
                    let n = usize::from(op - 0x84);
                    let items = self.pop_n(n)?;
                    self.push_made_of(&items)?;
                }
                b'R' | 0x81 => {
                    let items = self.pop_n(2)?;
                    self.push_made_of(&items)?;
                }
                0x92 => {
                    let items = self.pop_n(3)?;
                    self.push_made_of(&items)?;
                }
                // Stack shuffles.
                b'0' => drop(self.stack.pop().ok_or(Stop::LeftToDecoder)?),
                b'1' => drop(self.pop_to_mark()?),
                b'2' => {
                    let top = *self.stack.last().ok_or(Stop::LeftToDecoder)?;
                    self.stack.push(top);
                }
                // The memo.
                b'p' => {
                    let key = self.line_number()?;
                    self.remember(key)?;
                }
                b'q' => {
                    let key = u64::from(self.take(1)?[0]);
                    self.remember(key)?;
                }
                b'r' => {
                    let key = u64::from(self.u32_arg()?);
                    self.remember(key)?;
                }
                0x94 => {
                    let key = self.memo.len() as u64;
                    self.remember(key)?;
                }
                b'g' => {
                    let key = self.line_number()?;
                    self.recall(key)?;
                }
                b'h' => {
                    let key = u64::from(self.take(1)?[0]);
                    self.recall(key)?;
                }
                b'j' => {
                    let key = u64::from(self.u32_arg()?);
                    self.recall(key)?;
                }
                _ => return Err(Stop::LeftToDecoder),
            }
        }
    }

    fn take(&mut self, n: usize) -> Result<&[u8], Stop> {
        let end = self.pos.checked_add(n).ok_or(Stop::LeftToDecoder)?;
        let out = self.bytes.get(self.pos..end).ok_or(Stop::LeftToDecoder)?;
        self.pos = end;
        Ok(out)
    }

    fn u32_arg(&mut self) -> Result<u32, Stop> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn line(&mut self) -> Result<&[u8], Stop> {
        let rest = self.bytes.get(self.pos..).ok_or(Stop::LeftToDecoder)?;
        let len = rest
            .iter()
            .position(|&b| b == b'\n')
            .ok_or(Stop::LeftToDecoder)?;
        self.take(len + 1).map(|l| &l[..len])
    }

    fn line_number(&mut self) -> Result<u64, Stop> {
        let line = self.line()?;
        std::str::from_utf8(line)
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .ok_or(Stop::LeftToDecoder)
    }

    fn scalar(&mut self, arg: usize) -> Result<(), Stop> {
        self.take(arg)?;
        self.push_new(0);
        Ok(())
    }

    fn sized_scalar(&mut self, len_bytes: usize) -> Result<(), Stop> {
        let mut len = [0u8; 8];
        len[..len_bytes].copy_from_slice(self.take(len_bytes)?);
        let len = usize::try_from(u64::from_le_bytes(len)).map_err(|_| Stop::LeftToDecoder)?;
        self.scalar(len)
    }

    fn push_new(&mut self, depth: u32) {
        self.depths.push(depth);
        self.contained.push(false);
        self.stack.push(Item::Object(self.depths.len() - 1));
    }

    /// The top object (a mark counts as nothing to put anywhere).
    fn pop(&mut self) -> Result<Option<usize>, Stop> {
        match self.stack.pop() {
            Some(Item::Object(id)) => Ok(Some(id)),
            Some(Item::Mark) | None => Err(Stop::LeftToDecoder),
        }
    }

    fn pop_n(&mut self, n: usize) -> Result<Vec<Option<usize>>, Stop> {
        (0..n).map(|_| self.pop()).collect()
    }

    fn pop_to_mark(&mut self) -> Result<Vec<Option<usize>>, Stop> {
        let mut items = Vec::new();
        loop {
            match self.stack.pop() {
                Some(Item::Object(id)) => items.push(Some(id)),
                Some(Item::Mark) => return Ok(items),
                None => return Err(Stop::LeftToDecoder),
            }
        }
    }

    fn deepest(&self, items: &[Option<usize>]) -> u32 {
        items
            .iter()
            .flatten()
            .map(|&id| self.depths[id])
            .max()
            .unwrap_or(0)
    }

    fn too_deep(&self, depth: u32) -> Result<(), Stop> {
        if depth > self.max {
            return Err(Stop::Refused(format!(
                "containers nested more than {} levels deep (not a memory snapshot)",
                self.max
            )));
        }
        Ok(())
    }

    fn push_made_of(&mut self, items: &[Option<usize>]) -> Result<(), Stop> {
        let depth = self.deepest(items) + 1;
        self.too_deep(depth)?;
        for &id in items.iter().flatten() {
            self.contained[id] = true;
        }
        self.push_new(depth);
        Ok(())
    }

    fn put_into_top(&mut self, items: &[Option<usize>]) -> Result<(), Stop> {
        let Some(&Item::Object(target)) = self.stack.last() else {
            return Err(Stop::LeftToDecoder);
        };
        let depth = self.deepest(items) + 1;
        if depth > self.depths[target] {
            self.too_deep(depth)?;
            if self.contained[target] {
                return Err(Stop::Refused(
                    "a container grows deeper after it was put into another (not a memory \
                     snapshot)"
                        .into(),
                ));
            }
            self.depths[target] = depth;
        }
        for &id in items.iter().flatten() {
            self.contained[id] = true;
        }
        Ok(())
    }

    fn remember(&mut self, key: u64) -> Result<(), Stop> {
        match self.stack.last() {
            Some(&Item::Object(id)) => {
                self.memo.insert(key, id);
                Ok(())
            }
            _ => Err(Stop::LeftToDecoder),
        }
    }

    fn recall(&mut self, key: u64) -> Result<(), Stop> {
        let id = *self.memo.get(&key).ok_or(Stop::LeftToDecoder)?;
        self.stack.push(Item::Object(id));
        Ok(())
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// `[[[...]]]`, `depth` lists deep, built as Python's pickler would
    /// (outer list first, each inner one appended when complete).
    pub(crate) fn nested_lists(depth: usize) -> Vec<u8> {
        let mut p = vec![0x80, 2];
        p.extend(std::iter::repeat_n(b']', depth));
        p.extend(std::iter::repeat_n(b'a', depth - 1));
        p.push(b'.');
        p
    }

    #[test]
    fn shallow_pickles_pass_and_deep_ones_are_refused() {
        assert!(check(&nested_lists(10), MAX_DEPTH).is_ok());
        assert!(check(&nested_lists(200), MAX_DEPTH).is_ok());
        let err = check(&nested_lists(201), MAX_DEPTH).unwrap_err();
        assert!(err.contains("200 levels"), "{err}");
        assert!(check(&nested_lists(100_000), MAX_DEPTH).is_err());
    }

    #[test]
    fn tuples_made_of_tuples_count_too() {
        // `()` wrapped in a one-tuple 500 times: the stack never grows.
        let mut p = vec![0x80, 2, b')'];
        p.extend(std::iter::repeat_n(0x85, 500));
        p.push(b'.');
        assert!(check(&p, MAX_DEPTH).is_err());
        p.truncate(3 + 150);
        p.push(b'.');
        assert!(check(&p, MAX_DEPTH).is_ok());
    }

    #[test]
    fn a_memoized_container_grown_after_it_was_placed_is_refused() {
        // l0 = []; memo; l1 = [l0]; then l0 gets a list appended through the memo.
        let p = [
            0x80, 2, b']', b'q', 0, b']', b'h', 0, b'a', b'h', 0, b']', b'a', b'.',
        ];
        assert!(check(&p, MAX_DEPTH).unwrap_err().contains("grows deeper"));
    }

    #[test]
    fn what_the_decoder_reports_is_left_to_it() {
        for p in [
            &b""[..],
            b"\x80\x02]",
            b"\x80\x02a.",
            b"\xff",
            b"\x80\x02X\xff\xff\xff\xff",
        ] {
            assert!(check(p, MAX_DEPTH).is_ok());
        }
    }

    #[test]
    fn a_real_snapshot_passes() {
        let bytes = std::fs::read(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../traces/small_mlp.snapshot.pickle"
        ))
        .unwrap();
        check(&bytes, MAX_DEPTH).unwrap();
        // Its nesting is a handful of levels.
        assert!(check(&bytes, 12).is_ok());
    }
}
