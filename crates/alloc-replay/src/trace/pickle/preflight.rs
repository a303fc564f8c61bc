//! What decoding a pickle with serde-pickle would cost, and whether it holds
//! values serde-pickle cannot order, found by walking its opcodes without
//! building anything (how deep it nests is [`nesting`](super::super::nesting)'s
//! concern).
//!
//! serde-pickle copies values where Python shares them: `DUP` copies the
//! top item, and each use of a memoized value becomes a copy when the values
//! are converted. So a pickle of a hundred bytes can ask for exponential
//! memory (a tuple duplicated and paired with itself sixty times; found by
//! the `trace` fuzz target). Its ordering of set members is not total (NaN,
//! and floats against integers beyond 2^53), and the standard library's sort
//! panics on a set it finds out of order (also found by that target).
//!
//! [`check`] walks the opcodes as serde-pickle's unpickler does, keeping the
//! size of each item (a copy where serde-pickle copies) and of each memo
//! entry with the number of times it is used, and of each open `MARK` (a
//! fresh stack of 128 slots in serde-pickle, which a run of them once made
//! cost 4 KiB per input byte), and refuses a pickle whose decoding would
//! build more than the budget allows ([`max_units`]: proportional to the
//! input), or that makes a set (a memory snapshot has none). A PyTorch
//! snapshot costs about one unit per input byte. Anything
//! the walk does not follow (an unknown opcode, a stack underflow, a
//! truncated argument) ends it: serde-pickle then reports the error itself,
//! having built no more than the walk counted.

use std::collections::HashMap;

/// Bytes of decoded value one unit stands for: a value's slot, or this
/// many bytes of a string's payload.
pub(crate) const UNIT_BYTES: u64 = 32;

/// Units an open `MARK` holds: serde-pickle starts a fresh stack of 128
/// value slots at each one (4 KiB), and keeps the one it set aside.
const MARK_UNITS: u64 = 129;

/// Units a memo entry takes besides its value: its place in serde-pickle's
/// memo (a B-tree entry, about one slot) and the reference left on the
/// stack.
const MEMO_UNITS: u64 = 2;

/// Units per input byte decoding may build (256 bytes of values per byte
/// read): the bundled snapshots take 0.85 and 1.06, the one with stack
/// frames the more; the rest is room for deeper stacks and longer names.
pub(crate) const UNITS_PER_BYTE: u64 = 8;

/// Units any pickle may build, however short (2 MiB).
pub(crate) const BASE_UNITS: u64 = 1 << 16;

/// The most units decoding `len` input bytes may build:
/// [`UNITS_PER_BYTE`] per input byte and [`BASE_UNITS`].
pub(super) fn max_units(len: usize) -> u64 {
    (len as u64)
        .saturating_mul(UNITS_PER_BYTE)
        .saturating_add(BASE_UNITS)
}

/// Checks that decoding the pickle in `bytes` stays within the budget and
/// makes no set: the units it would build, or an error saying what is
/// wrong.
pub(super) fn check(bytes: &[u8]) -> Result<u64, String> {
    let mut walk = Walk::new(bytes.len());
    let mut at = 0;
    while let Some((op, next)) = opcode(bytes, at) {
        at = next;
        match walk.apply(op)? {
            Step::Go => {}
            Step::Stop(root) => return walk.resolved(root),
            Step::Fail => break,
        }
    }
    Ok(walk.built)
}

/// What the walk knows of a value.
#[derive(Debug, Clone, Default)]
struct Shape {
    /// Units it takes as parsed (a memo reference in it is one unit).
    size: u64,
    /// A short string's bytes (the name a STACK_GLOBAL looks up).
    text: Option<Box<[u8]>>,
}

impl Shape {
    fn scalar(payload: u64) -> Shape {
        Shape {
            size: 1 + payload / UNIT_BYTES,
            text: None,
        }
    }

    /// Takes `items` in (a container holding them, or one they are added to).
    fn absorb(&mut self, items: Vec<Shape>) {
        for item in items {
            self.size = self.size.saturating_add(item.size);
        }
    }
}

/// An item on the simulated stack.
#[derive(Debug, Clone)]
enum Item {
    Value(Shape),
    /// A reference to a memo entry (serde-pickle's `MemoRef`).
    Memo(u64),
}

/// A memo entry: its value and how often it may be copied out.
#[derive(Debug)]
struct Entry {
    shape: Shape,
    /// Stores and fetches: serde-pickle copies the value at most this often.
    uses: u64,
}

/// The simulated unpickler.
#[derive(Debug, Default)]
struct Walk {
    stack: Vec<Item>,
    marks: Vec<usize>,
    memo: HashMap<u64, Entry>,
    /// Units built while parsing.
    built: u64,
    limit: u64,
    /// A STACK_GLOBAL named `set` or `frozenset` (or a name not known).
    names_a_set: bool,
}

/// What an opcode does, for the walk.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Op<'a> {
    /// Protocol and framing: nothing.
    Skip,
    /// Pushes a scalar with a payload of this many bytes.
    Scalar(u64),
    /// Pushes a string of this many bytes, and its text where it is short
    /// and plain enough to be a global's name.
    Text(u64, Option<&'a [u8]>),
    /// Makes a set (or names `set` or `frozenset`).
    Set,
    /// Pushes an empty container.
    Empty,
    Mark,
    Stop,
    /// POP: the top item, or the mark when nothing is above it.
    Pop,
    PopMark,
    Dup,
    /// Memoizes the top item (at the memo's size when `None`).
    Put(Option<u64>),
    Get(u64),
    /// Pops this many items and pushes a container of them.
    Collect(usize),
    /// Pops to the mark and pushes a container of the items; `true` where
    /// the container keeps the mark's stack (a list or tuple: its 128
    /// slots however few items it holds).
    CollectMark(bool),
    /// Pops this many items into the item below them.
    AddTo(usize),
    /// Pops to the mark, into the item below the mark.
    AddMarkTo,
    /// BUILD: the top item replaces the one below it.
    Build,
    /// STACK_GLOBAL: a module and a name (resolved) become a global.
    StackGlobal,
    /// REDUCE: a callable and its arguments (resolved) become a value.
    Reduce,
    /// NEWOBJ (2) and NEWOBJ_EX (3): pops the items, pushes an empty stand-in.
    NewObj(usize),
    /// INST (0) and OBJ (1): pops to the mark and this many items, pushes a
    /// stand-in.
    Inst(usize),
}

/// How the walk goes on after an opcode.
enum Step {
    Go,
    /// STOP with the pickled value.
    Stop(Item),
    /// serde-pickle fails here.
    Fail,
}

impl Walk {
    /// A walk with the budget of an input of `len` bytes.
    fn new(len: usize) -> Walk {
        Walk {
            limit: max_units(len),
            ..Walk::default()
        }
    }

    /// The stack's floor: items below the innermost mark are out of reach.
    fn floor(&self) -> usize {
        self.marks.last().copied().unwrap_or(0)
    }

    fn pop_item(&mut self) -> Option<Item> {
        if self.stack.len() <= self.floor() {
            return None;
        }
        self.stack.pop()
    }

    /// The shape an item takes inside a container (a reference is a leaf).
    fn held(item: Item) -> Shape {
        match item {
            Item::Value(shape) => shape,
            Item::Memo(_) => Shape::scalar(0),
        }
    }

    /// A copy of a memo entry's value, as serde-pickle makes when it
    /// resolves a reference while parsing.
    fn copy_out(&mut self, id: u64) -> Option<Shape> {
        let shape = self.memo.get(&id)?.shape.clone();
        self.built = self.built.saturating_add(shape.size);
        Some(shape)
    }

    /// Pops an item, resolving a memo reference to a copy of its value.
    fn pop_resolved(&mut self) -> Option<Shape> {
        match self.pop_item()? {
            Item::Value(shape) => Some(shape),
            Item::Memo(id) => self.copy_out(id),
        }
    }

    fn pop_n(&mut self, n: usize) -> Option<Vec<Shape>> {
        (0..n).map(|_| self.pop_item().map(Self::held)).collect()
    }

    fn pop_mark(&mut self) -> Option<Vec<Shape>> {
        let mark = self.marks.pop()?;
        let items = self.stack.split_off(mark.min(self.stack.len()));
        Some(items.into_iter().map(Self::held).collect())
    }

    /// The value the top item stands for (a memo entry's, for a reference).
    fn top(&mut self) -> Option<&mut Shape> {
        if self.stack.len() <= self.floor() {
            return None;
        }
        match self.stack.last_mut()? {
            Item::Value(shape) => Some(shape),
            Item::Memo(id) => {
                let id = *id;
                self.memo.get_mut(&id).map(|e| &mut e.shape)
            }
        }
    }

    fn push(&mut self, shape: Shape) {
        self.built = self.built.saturating_add(shape.size);
        self.stack.push(Item::Value(shape));
    }

    /// Applies one opcode; an error once the budget is exceeded or a set
    /// made.
    fn apply(&mut self, op: Op) -> Result<Step, String> {
        let Some(step) = self.step(op) else {
            return Ok(Step::Fail);
        };
        if op == Op::Set || self.names_a_set {
            return Err("the pickle makes a set, which no memory snapshot has".into());
        }
        if self.live() > self.limit {
            return Err(self.over_budget());
        }
        Ok(step)
    }

    /// Applies `op` to the stack: `None` where serde-pickle fails.
    fn step(&mut self, op: Op) -> Option<Step> {
        match op {
            Op::Skip | Op::Set => {}
            Op::Scalar(payload) => self.push(Shape::scalar(payload)),
            Op::Text(payload, name) => self.push(Shape {
                text: name.map(Into::into),
                ..Shape::scalar(payload)
            }),
            Op::Empty => self.push(Shape::scalar(0)),
            Op::Mark => self.marks.push(self.stack.len()),
            Op::Stop => return Some(Step::Stop(self.pop_item()?)),
            Op::Pop => {
                if self.stack.len() <= self.floor() {
                    self.pop_mark()?;
                } else {
                    self.stack.pop();
                }
            }
            Op::PopMark => {
                self.pop_mark()?;
            }
            Op::Dup => {
                let copy = self.top()?.clone();
                self.push(copy);
            }
            Op::Put(id) => {
                let id = id.unwrap_or(self.memo.len() as u64);
                let shape = self.pop_resolved()?;
                let uses = self.memo.get(&id).map_or(0, |e| e.uses);
                self.memo.insert(
                    id,
                    Entry {
                        shape,
                        uses: uses.saturating_add(1),
                    },
                );
                self.built = self.built.saturating_add(MEMO_UNITS);
                self.stack.push(Item::Memo(id));
            }
            Op::Get(id) => {
                let entry = self.memo.get_mut(&id)?;
                entry.uses = entry.uses.saturating_add(1);
                // The reference's slot on serde-pickle's stack.
                self.built = self.built.saturating_add(1);
                self.stack.push(Item::Memo(id));
            }
            Op::Collect(n) => {
                let items = self.pop_n(n)?;
                self.collect(items);
            }
            Op::CollectMark(keeps_stack) => {
                let items = self.pop_mark()?;
                if keeps_stack {
                    self.built = self.built.saturating_add(MARK_UNITS);
                }
                self.collect(items);
            }
            Op::AddTo(n) => {
                let items = self.pop_n(n)?;
                self.top()?.absorb(items);
            }
            Op::AddMarkTo => {
                let items = self.pop_mark()?;
                self.top()?.absorb(items);
            }
            Op::Build => {
                let state = self.pop_item()?;
                self.pop_item()?;
                self.stack.push(state);
            }
            Op::StackGlobal => {
                let name = self.pop_resolved()?;
                self.pop_resolved()?;
                // A name not known here could be spelled to be `set`.
                self.names_a_set |= name.text.as_deref().is_none_or(is_set_name);
                self.push(Shape::scalar(0));
            }
            Op::Reduce => {
                let args = self.pop_resolved()?;
                let callable = self.pop_resolved()?;
                // set(), list(), bytearray() and the like make their value
                // of the arguments.
                let mut made = Shape::scalar(0);
                made.absorb(vec![args, callable]);
                self.push(made);
            }
            Op::NewObj(n) => {
                self.pop_n(n)?;
                self.push(Shape::scalar(0));
            }
            Op::Inst(n) => {
                self.pop_mark()?;
                self.pop_n(n)?;
                self.push(Shape::scalar(0));
            }
        }
        Some(Step::Go)
    }

    fn collect(&mut self, items: Vec<Shape>) {
        let mut container = Shape::scalar(0);
        // The items moved in; only the container is new.
        self.built = self.built.saturating_add(container.size);
        container.absorb(items);
        self.stack.push(Item::Value(container));
    }

    /// Units built so far and held by open marks: the open marks' stacks
    /// are given back when they close, so they count while they are open.
    fn live(&self) -> u64 {
        let marks = (self.marks.len() as u64).saturating_mul(MARK_UNITS);
        self.built.saturating_add(marks)
    }

    fn over_budget(&self) -> String {
        format!(
            "decoding the pickle would build more than {} MiB of values: not a memory snapshot \
             (a pickle that copies values over and over, or leaves marks open by the \
             thousand)",
            self.limit.saturating_mul(UNIT_BYTES) >> 20
        )
    }

    /// Checks what converting the value `root` costs: every memo entry
    /// copied out as often as it is used (serde-pickle copies it at most that
    /// often); the units in all.
    fn resolved(&self, root: Item) -> Result<u64, String> {
        let copies = self.memo.values().fold(Self::held(root).size, |sum, e| {
            sum.saturating_add(e.uses.saturating_mul(e.shape.size))
        });
        let units = self.built.saturating_add(copies);
        if units > self.limit {
            return Err(self.over_budget());
        }
        Ok(units)
    }
}

/// Whether a global's name makes sets (serde-pickle's `Global::Set` and
/// `Global::Frozenset`).
fn is_set_name(name: &[u8]) -> bool {
    name == b"set" || name == b"frozenset"
}

/// Longest string kept as text: longer ones are no global names this walk
/// needs to recognise.
const NAME_BYTES: u64 = 64;

/// Reads `n` little-endian bytes at `at` as an integer.
fn le(bytes: &[u8], at: usize, n: usize) -> Option<u64> {
    let raw = bytes.get(at..at.checked_add(n)?)?;
    Some(raw.iter().rev().fold(0, |v, &b| v << 8 | u64::from(b)))
}

/// The end (past the newline) of the line starting at `at`.
fn line_end(bytes: &[u8], at: usize) -> Option<usize> {
    let len = bytes.get(at..)?.iter().position(|&b| b == b'\n')?;
    Some(at + len + 1)
}

/// A decimal memo index on the line `at..end` (`g` and `p` opcodes).
fn text_index(bytes: &[u8], at: usize, end: usize) -> Option<u64> {
    std::str::from_utf8(bytes.get(at..end - 1)?)
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// The opcode at `at` and where the next one starts; `None` for an opcode
/// serde-pickle does not support, or a truncated argument.
fn opcode(bytes: &[u8], at: usize) -> Option<(Op<'_>, usize)> {
    let arg = at + 1;
    // A scalar whose argument takes `n` bytes.
    let fixed = |n: usize| Some((Op::Scalar(0), arg + n));
    // A string or number whose payload follows its `n`-byte length.
    let counted = |n: usize| {
        let len = le(bytes, arg, n)?;
        let start = arg.checked_add(n)?;
        let end = start.checked_add(usize::try_from(len).ok()?)?;
        let payload = bytes.get(start..end)?;
        Some((Op::Text(len, (len <= NAME_BYTES).then_some(payload)), end))
    };
    // A scalar spelled out on the rest of the line; a string's text is kept
    // where it is plain (quotes stripped, no escapes).
    let line = || {
        let end = line_end(bytes, arg)?;
        let raw = bytes[arg..end - 1].trim_ascii();
        let quoted = |q: &[u8]| raw.strip_prefix(q).and_then(|t| t.strip_suffix(q));
        let plain = quoted(b"'").or_else(|| quoted(b"\"")).unwrap_or(raw);
        let named = plain.len() as u64 <= NAME_BYTES && !plain.contains(&b'\\');
        Some((Op::Text((end - arg) as u64, named.then_some(plain)), end))
    };
    Some(match *bytes.get(at)? {
        0x80 => (Op::Skip, arg + 1),
        0x95 => (Op::Skip, arg + 8),
        b'(' => (Op::Mark, arg),
        b'.' => (Op::Stop, arg),
        b'0' => (Op::Pop, arg),
        b'1' => (Op::PopMark, arg),
        b'2' => (Op::Dup, arg),
        b'N' | 0x88 | 0x89 => (Op::Scalar(0), arg),
        b'K' => fixed(1)?,
        b'M' => fixed(2)?,
        b'J' => fixed(4)?,
        b'G' => fixed(8)?,
        b'U' | b'C' | 0x8c | 0x8a => counted(1)?,
        b'T' | b'B' | b'X' | 0x8b => counted(4)?,
        0x8d | 0x8e | 0x96 => counted(8)?,
        b'I' | b'L' | b'F' | b'S' | b'V' => line()?,
        b'c' => {
            let name = line_end(bytes, arg)?;
            let end = line_end(bytes, name)?;
            let op = if is_set_name(bytes[name..end - 1].trim_ascii()) {
                Op::Set
            } else {
                Op::Scalar(0)
            };
            (op, end)
        }
        b'i' => (Op::Inst(0), line_end(bytes, line_end(bytes, arg)?)?),
        b'o' => (Op::Inst(1), arg),
        b']' | b')' | b'}' => (Op::Empty, arg),
        // EMPTY_SET, ADDITEMS, FROZENSET.
        0x8f..=0x91 => (Op::Set, arg),
        b'a' => (Op::AddTo(1), arg),
        b's' => (Op::AddTo(2), arg),
        b'e' | b'u' => (Op::AddMarkTo, arg),
        b'l' | b't' => (Op::CollectMark(true), arg),
        b'd' => (Op::CollectMark(false), arg),
        0x85 => (Op::Collect(1), arg),
        0x86 => (Op::Collect(2), arg),
        0x87 => (Op::Collect(3), arg),
        b'b' => (Op::Build, arg),
        0x93 => (Op::StackGlobal, arg),
        b'R' => (Op::Reduce, arg),
        0x81 => (Op::NewObj(2), arg),
        0x92 => (Op::NewObj(3), arg),
        0x94 => (Op::Put(None), arg),
        b'q' => (Op::Put(Some(le(bytes, arg, 1)?)), arg + 1),
        b'r' => (Op::Put(Some(le(bytes, arg, 4)?)), arg + 4),
        b'p' => {
            let end = line_end(bytes, arg)?;
            (Op::Put(Some(text_index(bytes, arg, end)?)), end)
        }
        b'h' => (Op::Get(le(bytes, arg, 1)?), arg + 1),
        b'j' => (Op::Get(le(bytes, arg, 4)?), arg + 4),
        b'g' => {
            let end = line_end(bytes, arg)?;
            (Op::Get(text_index(bytes, arg, end)?), end)
        }
        _ => return None,
    })
}

#[cfg(test)]
mod tests;
