//! [`Op`]s decoded from fuzz input (cargo feature `arbitrary`): mostly
//! values the engine serves (log-uniform sizes, the model's streams, memory
//! fractions in tenths), sometimes the edges (sizes at pool and segment
//! boundaries, 0, above [`MAX_REQUEST`]), raw values that must be refused
//! (any `u64` size, NaN fractions) and any stream handle.

use alloc_core::{StreamId, MAX_REQUEST, MIB};
use arbitrary::{Arbitrary, Result, Unstructured};

use super::ops::{log_size, Op, POOLS, STREAMS};

/// Sizes where rounding, pools and segment sizes change.
const EDGE_SIZES: [u64; 13] = [
    0,
    1,
    511,
    512,
    513,
    MIB,
    MIB + 1,
    10 * MIB,
    20 * MIB,
    20 * MIB + 1,
    MAX_REQUEST,
    MAX_REQUEST + 1,
    u64::MAX,
];

/// Fractions outside `[0, 1]`, which must be refused.
const BAD_FRACTIONS: [f64; 5] = [f64::NAN, -0.1, 1.5, f64::INFINITY, f64::NEG_INFINITY];

fn size(u: &mut Unstructured) -> Result<u64> {
    Ok(match u.int_in_range(0u8..=15)? {
        0..=11 => log_size(f64::from(u.int_in_range(0u32..=28_000)?) / 1000.0),
        12..=14 => *u.choose(&EDGE_SIZES)?,
        _ => u.arbitrary()?,
    })
}

fn stream(u: &mut Unstructured) -> Result<StreamId> {
    Ok(match u.int_in_range(0u8..=15)? {
        0..=14 => *u.choose(&STREAMS)?,
        _ => StreamId(u.arbitrary()?),
    })
}

fn fraction(u: &mut Unstructured) -> Result<f64> {
    Ok(match u.int_in_range(0u8..=15)? {
        tenths @ 0..=10 => f64::from(tenths) / 10.0,
        11..=13 => *u.choose(&BAD_FRACTIONS)?,
        _ => f64::from_bits(u.arbitrary()?),
    })
}

fn pick(u: &mut Unstructured) -> Result<usize> {
    Ok(usize::from(u.arbitrary::<u16>()?))
}

impl<'a> Arbitrary<'a> for Op {
    fn arbitrary(u: &mut Unstructured<'a>) -> Result<Self> {
        Ok(match u.int_in_range(0u8..=21)? {
            0..=4 => Op::Alloc {
                size: size(u)?,
                stream: stream(u)?,
            },
            5..=8 => Op::Free { pick: pick(u)? },
            9 => Op::FreeInterior {
                pick: pick(u)?,
                offset: u.arbitrary()?,
            },
            10 => Op::RecordStream {
                pick: pick(u)?,
                stream: stream(u)?,
            },
            11 => Op::CompleteStream { stream: stream(u)? },
            12 => Op::Tick,
            13 => Op::ProcessEvents,
            14 => Op::EmptyCache,
            15 => Op::BeginCapture {
                pool: u.int_in_range(1..=POOLS)?,
            },
            16 => Op::EndCapture,
            17 => Op::ReleasePool {
                pool: u.int_in_range(1..=POOLS)?,
            },
            18 => Op::SetFraction {
                fraction: fraction(u)?,
            },
            19 => Op::Launch { stream: stream(u)? },
            20 => Op::WaitStream {
                waiter: stream(u)?,
                on: stream(u)?,
            },
            _ => Op::Snapshot,
        })
    }
}
