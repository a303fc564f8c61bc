//! Streams the allocator may hand to the driver.
//!
//! The engine names streams by their raw `CUstream` value ([`StreamId`]).
//! A value reaches the driver (`cuEventRecord`, `cuStreamWaitEvent`) only
//! if it was registered with the stream backend first, and registering
//! takes a [`StreamHandle`]: built safely from a cudarc stream, whose `Arc`
//! the backend then holds, or from a raw value through an `unsafe fn` whose
//! caller vouches for it. So no safe code can make the driver see a bogus
//! stream, however it drives the engine.
//!
//! The backend keeps a registered cudarc stream alive while the engine may
//! still use it: while a segment or block of the allocator belongs to it
//! (growable segments record events on their stream; a cached block is
//! reused by the next request on the same stream value) or a live block
//! was recorded on it (its free records an event there). A stream dropped
//! by its owner while the cache holds its blocks is therefore destroyed
//! only once those blocks are gone ([`crate::CudaAllocator::empty_cache`]),
//! and its handle value cannot be taken by a new stream before then: that
//! new stream would otherwise be handed the old stream's cached blocks
//! while the old stream's queued work still used them.

use std::sync::Arc;

use alloc_core::StreamId;
use cudarc::driver::{sys, CudaStream};
use rustc_hash::FxHashMap;

/// A stream an allocator may use: a cudarc stream it keeps alive, or a raw
/// `CUstream` vouched for by an `unsafe` caller (a stream owned by another
/// library, e.g. PyTorch's current stream in the C library).
///
/// ```no_run
/// use alloc_cuda::{CudaAllocator, StreamHandle};
///
/// let alloc = CudaAllocator::global(0)?;
/// let stream = alloc.context().new_stream()?;
/// let handle = StreamHandle::new(&stream); // holds the Arc
/// let ptr = alloc.malloc(1 << 20, &handle)?; // as `alloc.malloc(1 << 20, &stream)`
/// alloc.free(ptr)?;
/// // A stream some other library owns: only through `unsafe`.
/// // SAFETY: `stream` is a live stream of device 0's primary context and
/// // outlives every use the allocator makes of it (it holds an Arc here).
/// let raw = unsafe { StreamHandle::from_raw(stream.cu_stream()) };
/// assert_eq!(raw.id(), handle.id());
/// # Ok::<(), alloc_cuda::CudaError>(())
/// ```
#[derive(Clone, Debug)]
pub struct StreamHandle(Kind);

#[derive(Clone, Debug)]
enum Kind {
    Cudarc(Arc<CudaStream>),
    Raw(StreamId),
}

impl StreamHandle {
    /// A handle holding `stream` (an `Arc` clone): the allocator keeps the
    /// stream alive for as long as it may use it.
    pub fn new(stream: &Arc<CudaStream>) -> Self {
        StreamHandle(Kind::Cudarc(stream.clone()))
    }

    /// A handle on a raw `CUstream` the caller does not give the allocator
    /// a share of.
    ///
    /// # Safety
    /// `stream` must be the legacy default stream (null), the per-thread
    /// default stream (`CU_STREAM_PER_THREAD`), or a stream of the primary
    /// context of the device whose allocator it is given to, alive until
    /// that allocator holds nothing of it: every block allocated on it and
    /// every block recorded on it freed, the segments of its blocks given
    /// back (`empty_cache`, or the allocator dropped). The allocator records
    /// events on it and makes it wait on events until then.
    pub unsafe fn from_raw(stream: sys::CUstream) -> Self {
        StreamHandle(Kind::Raw(StreamId(stream as usize as u64)))
    }

    /// The engine's id of the stream: its raw `CUstream` value.
    pub fn id(&self) -> StreamId {
        self.as_ref().id()
    }

    /// The cudarc stream, for a handle made by [`StreamHandle::new`].
    pub fn cudarc(&self) -> Option<&Arc<CudaStream>> {
        match &self.0 {
            Kind::Cudarc(s) => Some(s),
            Kind::Raw(_) => None,
        }
    }

    pub(crate) fn as_ref(&self) -> StreamRef<'_> {
        match &self.0 {
            Kind::Cudarc(s) => StreamRef::Cudarc(s),
            Kind::Raw(id) => StreamRef::Raw(*id),
        }
    }
}

impl From<&Arc<CudaStream>> for StreamHandle {
    fn from(stream: &Arc<CudaStream>) -> Self {
        StreamHandle::new(stream)
    }
}

impl From<Arc<CudaStream>> for StreamHandle {
    fn from(stream: Arc<CudaStream>) -> Self {
        StreamHandle(Kind::Cudarc(stream))
    }
}

mod sealed {
    use super::*;

    /// A borrowed [`StreamHandle`], or a cudarc stream not yet wrapped in
    /// one: registering clones the `Arc` only for a stream not registered
    /// yet. (Public inside this private module: the sealed trait names it.)
    #[derive(Clone, Copy, Debug)]
    pub enum StreamRef<'a> {
        /// A cudarc stream.
        Cudarc(&'a Arc<CudaStream>),
        /// A raw handle vouched for by its creator.
        Raw(StreamId),
    }

    impl StreamRef<'_> {
        /// The engine's id of the stream.
        pub fn id(self) -> StreamId {
            match self {
                StreamRef::Cudarc(s) => crate::stream_id(s),
                StreamRef::Raw(id) => id,
            }
        }

        /// An owned handle on the same stream (an `Arc` clone for a cudarc
        /// stream).
        pub fn to_handle(self) -> StreamHandle {
            match self {
                StreamRef::Cudarc(s) => StreamHandle::new(s),
                StreamRef::Raw(id) => StreamHandle(Kind::Raw(id)),
            }
        }
    }

    /// The sealed part of [`AsStream`].
    pub trait Sealed {
        /// The stream, borrowed.
        fn stream_ref(&self) -> StreamRef<'_>;
    }
}

pub(crate) use sealed::StreamRef;

/// What the allocator's stream arguments accept: a cudarc stream
/// (`&Arc<CudaStream>`, the allocator keeps a clone of the `Arc` while it
/// may use the stream) or a [`StreamHandle`]. Sealed: a raw `CUstream`
/// becomes a stream argument only through [`StreamHandle::from_raw`].
pub trait AsStream: sealed::Sealed {}

impl sealed::Sealed for Arc<CudaStream> {
    fn stream_ref(&self) -> StreamRef<'_> {
        StreamRef::Cudarc(self)
    }
}
impl AsStream for Arc<CudaStream> {}

impl sealed::Sealed for StreamHandle {
    fn stream_ref(&self) -> StreamRef<'_> {
        self.as_ref()
    }
}
impl AsStream for StreamHandle {}

/// The [`StreamRef`] of a stream argument.
pub(crate) fn stream_ref<S: AsStream + ?Sized>(stream: &S) -> StreamRef<'_> {
    sealed::Sealed::stream_ref(stream)
}

/// Fewest entries at which [`StreamTable::wants_pruning`] asks for a prune.
const MIN_PRUNE_AT: usize = 16;

/// The streams registered with a stream backend, by id, each with what
/// keeps it alive: `Some(owner)` (a cudarc `Arc` in the backend) or `None`
/// (a raw handle whose caller vouched for it). Generic over the owner so
/// that its logic is tested without a GPU.
#[derive(Debug)]
pub(crate) struct StreamTable<O> {
    entries: FxHashMap<StreamId, Option<O>>,
    /// The last id registered: registering it again is one comparison
    /// (consecutive requests mostly name the same stream).
    last: Option<StreamId>,
    /// Whether that entry has an owner.
    last_owned: bool,
    /// Entries at which a prune is due: twice the count left by the last
    /// prune, so pruning costs O(1) per registration amortised.
    prune_at: usize,
}

impl<O> Default for StreamTable<O> {
    fn default() -> Self {
        StreamTable {
            entries: FxHashMap::default(),
            last: None,
            last_owned: false,
            prune_at: MIN_PRUNE_AT,
        }
    }
}

impl<O> StreamTable<O> {
    /// Registers `id`, kept alive by the owner `owner` makes (`None`: a raw
    /// handle whose caller vouched for it). An id registered raw and later
    /// with an owner keeps the owner.
    pub(crate) fn register(&mut self, id: StreamId, owner: Option<impl FnOnce() -> O>) {
        if self.last == Some(id) && (self.last_owned || owner.is_none()) {
            return;
        }
        let entry = self.entries.entry(id).or_insert(None);
        if entry.is_none() {
            if let Some(make) = owner {
                *entry = Some(make());
            }
        }
        self.last = Some(id);
        self.last_owned = entry.is_some();
    }

    /// What keeps `id` alive: `None` when it is not registered or was
    /// registered raw only.
    pub(crate) fn owner(&self, id: StreamId) -> Option<&O> {
        self.entries.get(&id)?.as_ref()
    }

    /// Whether `id` is registered.
    pub(crate) fn contains(&self, id: StreamId) -> bool {
        self.entries.contains_key(&id)
    }

    /// Registered streams.
    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether enough streams were registered since the last prune that
    /// the owner of the table should prune it.
    pub(crate) fn wants_pruning(&self) -> bool {
        self.entries.len() >= self.prune_at
    }

    /// Forgets every stream `keep` refuses, dropping its owner.
    pub(crate) fn retain(&mut self, mut keep: impl FnMut(StreamId) -> bool) {
        self.entries.retain(|&id, _| keep(id));
        if self.last.is_some_and(|id| !self.entries.contains_key(&id)) {
            self.last = None;
        }
        self.prune_at = (2 * self.entries.len()).max(MIN_PRUNE_AT);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::rc::Rc;

    /// No owner: a raw registration.
    const RAW: Option<fn() -> Rc<()>> = None;

    #[test]
    fn registered_streams_keep_their_owner_until_pruned() {
        let mut table: StreamTable<Rc<()>> = StreamTable::default();
        let owner = Rc::new(());
        table.register(StreamId(7), Some(|| owner.clone()));
        assert_eq!(Rc::strong_count(&owner), 2, "the table holds the owner");
        // Registering again clones nothing.
        table.register(StreamId(7), Some(|| owner.clone()));
        table.register(
            StreamId(7),
            Some(|| -> Rc<()> { panic!("the fast path makes no owner") }),
        );
        table.register(StreamId(8), RAW);
        table.register(
            StreamId(7),
            Some(|| -> Rc<()> { panic!("an owned entry makes no owner") }),
        );
        assert_eq!(Rc::strong_count(&owner), 2);
        assert!(
            table.contains(StreamId(7))
                && table.contains(StreamId(8))
                && !table.contains(StreamId(9))
        );
        table.retain(|id| id != StreamId(7));
        assert!(!table.contains(StreamId(7)));
        assert_eq!(Rc::strong_count(&owner), 1, "pruning drops the owner");
        // After a prune, the fast path does not claim a forgotten stream.
        table.register(StreamId(7), RAW);
        assert!(table.contains(StreamId(7)));
    }

    #[test]
    fn a_raw_entry_takes_an_owner_later_but_never_loses_one() {
        let mut table: StreamTable<Rc<()>> = StreamTable::default();
        let owner = Rc::new(());
        table.register(StreamId(3), RAW);
        table.register(StreamId(3), RAW); // the fast path
        assert_eq!(table.len(), 1);
        assert!(
            table.owner(StreamId(3)).is_none(),
            "a raw entry has no owner"
        );
        table.register(StreamId(3), Some(|| owner.clone()));
        assert_eq!(Rc::strong_count(&owner), 2, "upgraded to an owned entry");
        assert!(table
            .owner(StreamId(3))
            .is_some_and(|o| Rc::ptr_eq(o, &owner)));
        table.register(StreamId(4), RAW);
        table.register(StreamId(3), RAW); // a raw registration keeps the owner
        assert_eq!(Rc::strong_count(&owner), 2);
        assert_eq!(table.len(), 2);
        // A second owner of a registered id is not taken: the first stays.
        let other = Rc::new(());
        table.register(StreamId(3), Some(|| other.clone()));
        assert!(table
            .owner(StreamId(3))
            .is_some_and(|o| Rc::ptr_eq(o, &owner)));
        assert_eq!(Rc::strong_count(&other), 1);
        assert!(table.owner(StreamId(9)).is_none(), "never registered");
    }

    #[test]
    fn pruning_is_due_after_the_table_doubles() {
        let mut table: StreamTable<Rc<()>> = StreamTable::default();
        for id in 0..MIN_PRUNE_AT as u64 - 1 {
            table.register(StreamId(id), RAW);
        }
        assert!(!table.wants_pruning());
        table.register(StreamId(1000), RAW);
        assert!(table.wants_pruning());
        // Twenty streams stay in use: the next prune is due at forty.
        for id in 2000..2020 {
            table.register(StreamId(id), RAW);
        }
        table.retain(|id| id >= StreamId(2000));
        assert_eq!(table.len(), 20);
        assert!(!table.wants_pruning());
        for id in 3000..3019 {
            table.register(StreamId(id), RAW);
        }
        assert!(!table.wants_pruning());
        table.register(StreamId(4000), RAW);
        assert!(table.wants_pruning());
        table.retain(|_| false);
        assert_eq!(table.len(), 0);
        assert!(!table.wants_pruning());
    }
}
