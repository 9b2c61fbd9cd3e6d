//! Wire framing of the QUIC backend: rkyv control messages validated on receipt, and tensor
//! payloads as raw little-endian f32/f64 bytes in checksummed chunks.
//!
//! One message travels on one unidirectional QUIC stream:
//!
//! ```text
//! [u32 LE header_len ≤ FRAME_BYTES_MAX][header: rkyv-archived Control, validated by bytecheck]
//! if Control::Data { elems, elem, .. }:
//!   repeat until elems × elem_bytes bytes arrived:
//!     [u32 LE chunk_len ≤ CHUNK_BYTES_MAX, multiple of elem_bytes][u32 LE crc32c(chunk)][chunk]
//! end of stream (any trailing byte is an error)
//! ```
//!
//! The sender copies each chunk once, behind its prefix, into a buffer that quinn keeps as it is
//! ([`Sends`]), or, for a collective's payload, hands quinn the tensor's own bytes behind a
//! prefix of their own ([`write_message_with`], [`Lend`]; `quic::lend` makes that sound), with
//! the checksums the bytes arrived with when it forwards what it received. The receiver takes the buffers quinn decrypted the packets into ([`Pieces`]),
//! checks a chunk's CRC32C over them, and only then copies it into its destination — the
//! caller's tensor ([`read_payload_into`]), a reused buffer ([`read_payload_visit`]) or a new
//! `Vec<f32>`/`Vec<f64>` — or adds it in place ([`read_payload_add`]). The byte order is the
//! host's: the backend assumes little-endian hosts (x86-64, aarch64). QUIC's AEAD already protects against tampering on the wire; the per-chunk CRC32C
//! catches framing bugs and memory corruption between the socket and the tensor.

use bytes::Bytes;
use rkyv::rancor;
use rkyv::util::AlignedVec;

/// Largest accepted control header, in bytes.
pub const FRAME_BYTES_MAX: usize = 1 << 20;
/// Largest payload chunk accepted, in bytes.
pub const CHUNK_BYTES_MAX: usize = 1 << 20;
/// Payload chunk the sender writes (all but the last chunk have exactly this size): 256 KiB stays
/// in a core's L2 cache between copying it and computing its checksum, on both sides (1 MiB
/// chunks measured no cheaper: docs/PERFORMANCE.md).
pub const SEND_CHUNK_BYTES: usize = 256 << 10;
/// Messages up to this size (header, one chunk prefix and payload) are written in one piece.
pub const COALESCE_BYTES_MAX: usize = 16 << 10;
/// Largest payload of one message, in bytes (16 GiB).
pub const MESSAGE_BYTES_MAX: u64 = 1 << 34;
/// Most payload memory reserved before any chunk arrived (larger payloads grow as chunks come).
const PREALLOC_BYTES_MAX: usize = 1 << 26;

/// Element type of a payload: 0 = f32, 1 = f64.
pub const ELEM_F32: u8 = 0;
pub const ELEM_F64: u8 = 1;

/// What a data message is for; every key is delivered at most once per sender.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub enum Key {
    /// Operation descriptor of collective number `seq` (every rank sends one to every peer).
    Desc { seq: u64 },
    /// Step `step` of collective number `seq`.
    Coll { seq: u64, step: u32 },
    /// The `n`-th point-to-point message under `tag` from this sender to this receiver.
    P2p { tag: u64, n: u64 },
}

/// What every rank declares on entering a collective, so that all ranks can check agreement.
#[derive(Debug, Clone, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct OpDesc {
    /// Operation code (see `comm::Op`).
    pub op: u8,
    /// Operation-specific lengths (input, output, …) and root.
    pub lens: Vec<u64>,
    /// Range ends, when the operation takes ranges (`ranges[r] = ends[r-1]..ends[r]`).
    pub ends: Vec<u64>,
    /// Lanes the sender receives large payloads on (the fewest it has with any peer): senders
    /// cut what they send it into that many stripes (see `comm::stripe_count`).
    pub lanes: u32,
}

/// A control message (the header of every stream).
#[derive(Debug, Clone, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub enum Control {
    /// First stream of a connection: the sender's rank (checked against its certificate), and
    /// which of the pair's `lanes` parallel connections this is (see `net::build_mesh`). The
    /// acceptor's answer on lane 0 names the UDP ports of its lanes 1.. (empty otherwise).
    Hello { rank: u32, world: u32, lane: u32, lanes: u32, ports: Vec<u16> },
    /// A tensor payload of `elems` elements of type `elem` follows in chunks.
    Data { key: Key, elem: u8, elems: u64 },
    /// A collective's descriptor (no payload).
    Desc { seq: u64, desc: OpDesc },
    /// The sender aborted the group.
    Abort { reason: String },
    /// The sender is leaving after `streams` data/descriptor streams to this peer.
    Bye { streams: u64 },
    /// Every stream announced by a `Bye` has been received.
    ByeAck,
}

/// A received tensor payload.
#[derive(Debug, Clone, PartialEq)]
pub enum Payload {
    F32(Vec<f32>),
    F64(Vec<f64>),
}

/// Why a received frame was rejected (the connection to that peer is then closed).
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    #[error("stream ended early while reading {what}")]
    Truncated { what: &'static str },
    #[error("{what} of {bytes} bytes exceeds the limit of {limit} bytes")]
    Oversized { what: &'static str, bytes: u64, limit: u64 },
    #[error("control header does not validate: {detail}")]
    Malformed { detail: String },
    #[error("chunk {index} checksum {got:#010x} but the sender stated {want:#010x}")]
    Checksum { index: u64, got: u32, want: u32 },
    #[error("bad chunk {index}: {detail}")]
    BadChunk { index: u64, detail: String },
    #[error("{extra} unexpected byte(s) after the message")]
    Trailing { extra: usize },
    #[error("stream read failed: {0}")]
    Io(#[from] std::io::Error),
}

/// Serialises a control header (rkyv).
pub fn encode_control(control: &Control) -> Vec<u8> {
    // Serialising plain owned data into a growable buffer cannot fail.
    match rkyv::to_bytes::<rancor::Error>(control) {
        Ok(bytes) => bytes.to_vec(),
        Err(e) => unreachable!("rkyv serialisation of an owned value failed: {e}"),
    }
}

/// Validates (bytecheck) and deserialises a control header.
pub fn decode_control(bytes: &[u8]) -> Result<Control, FrameError> {
    let mut aligned = AlignedVec::<16>::with_capacity(bytes.len());
    aligned.extend_from_slice(bytes);
    decode_aligned(&aligned)
}

fn decode_aligned(aligned: &AlignedVec<16>) -> Result<Control, FrameError> {
    rkyv::from_bytes::<Control, rancor::Error>(aligned).map_err(|e| FrameError::Malformed { detail: e.to_string() })
}

/// Where a message's bytes go: owned buffers handed over whole. A QUIC send stream keeps each
/// as it is until the peer acknowledges it (`SendStream::write_chunk`), where a written slice
/// would be copied into a new buffer of its own first.
pub trait Sends {
    /// Queues `bytes` after everything sent before.
    fn send(&mut self, bytes: Bytes) -> impl std::future::Future<Output = std::io::Result<()>> + Send;
    /// Queues `parts` one after the other (one write).
    fn send_all(&mut self, parts: &mut [Bytes]) -> impl std::future::Future<Output = std::io::Result<()>> + Send;
}

impl Sends for quinn::SendStream {
    async fn send(&mut self, bytes: Bytes) -> std::io::Result<()> {
        Ok(self.write_chunk(bytes).await?)
    }

    async fn send_all(&mut self, parts: &mut [Bytes]) -> std::io::Result<()> {
        Ok(self.write_all_chunks(parts).await?)
    }
}

impl Sends for Vec<u8> {
    async fn send(&mut self, bytes: Bytes) -> std::io::Result<()> {
        self.extend_from_slice(&bytes);
        Ok(())
    }

    async fn send_all(&mut self, parts: &mut [Bytes]) -> std::io::Result<()> {
        parts.iter().for_each(|p| self.extend_from_slice(p));
        Ok(())
    }
}

/// Hands a payload's bytes to the writer without copying them (see `quic::lend`, which makes it
/// sound: the bytes stay borrowed until the writer has them back).
pub trait Lend<'p> {
    /// `bytes` as a `Bytes` that the writer may hold.
    fn lend(&self, bytes: &'p [u8]) -> Bytes;
}

/// Copies every chunk (the [`write_message_with`] of [`write_message`]).
pub struct Copied;

impl Lend<'_> for Copied {
    fn lend(&self, bytes: &[u8]) -> Bytes {
        Bytes::copy_from_slice(bytes)
    }
}

/// A payload chunk as it travelled: its length and CRC32C. A receiver records them
/// ([`read_payload_into`]) so that, forwarding the same bytes cut the same way, it sends the
/// checksums they arrived with instead of computing them again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkSum {
    pub len: u32,
    pub crc: u32,
}

/// Writes one message: its header and, for `Control::Data`, `payload` in checksummed chunks of
/// [`SEND_CHUNK_BYTES`]. A message of at most [`COALESCE_BYTES_MAX`] goes out in a single write
/// (one QUIC packet on the wire), so a small message never waits for a second wake-up of the
/// connection. A large payload goes out chunk by chunk, each chunk with its prefix in one buffer
/// ([`checked_chunk`]): the payload is copied once on its way to the wire by this code, and
/// never again by QUIC before it is packetised.
pub async fn write_message<W: Sends>(w: &mut W, control: &Control, payload: &[u8]) -> std::io::Result<()> {
    write_message_with(w, control, payload, None::<&Copied>, None).await
}

/// [`write_message`], where a large payload's chunks but the last are handed to the writer by
/// `lend` (when given) instead of being copied, each behind a prefix of its own, and where `sums`
/// (when they match the payload's chunks, length by length) are the chunks' checksums, which are
/// then not computed again.
///
/// The last chunk is always copied. Every lent chunk is then followed on the stream by at least
/// one more packet, so the peer acknowledges the lent chunks as soon as they arrive (QUIC
/// acknowledges every second packet at once, an odd last packet only after its delayed-ACK wait):
/// the writer gets them back without that wait.
pub async fn write_message_with<'p, W: Sends, L: Lend<'p> + Sync>(
    w: &mut W,
    control: &Control,
    payload: &'p [u8],
    lend: Option<&L>,
    sums: Option<&[ChunkSum]>,
) -> std::io::Result<()> {
    let header = encode_control(control);
    let small = 4 + header.len() + 8 + payload.len() <= COALESCE_BYTES_MAX;
    let mut head = Vec::with_capacity(4 + header.len() + if small { 8 + payload.len() } else { 0 });
    head.extend_from_slice(&(header.len() as u32).to_le_bytes());
    head.extend_from_slice(&header);
    if small {
        for chunk in payload.chunks(SEND_CHUNK_BYTES) {
            head.extend_from_slice(&chunk_prefix(chunk.len(), super::crc::crc32c(chunk)));
            head.extend_from_slice(chunk);
        }
        return w.send(head.into()).await;
    }
    w.send(head.into()).await?;
    let chunks = payload.len().div_ceil(SEND_CHUNK_BYTES);
    let sums = sums.filter(|s| s.len() == chunks && s.iter().zip(payload.chunks(SEND_CHUNK_BYTES)).all(|(s, c)| s.len as usize == c.len()));
    for (i, chunk) in payload.chunks(SEND_CHUNK_BYTES).enumerate() {
        let crc = sums.map(|s| s[i].crc);
        match lend.filter(|_| i + 1 < chunks) {
            Some(lend) => {
                let prefix = chunk_prefix(chunk.len(), crc.unwrap_or_else(|| super::crc::crc32c(chunk)));
                w.send_all(&mut [Bytes::copy_from_slice(&prefix), lend.lend(chunk)]).await?;
            }
            None => w.send(checked_chunk(chunk, crc)).await?,
        }
    }
    Ok(())
}

/// `[u32 LE length][u32 LE crc32c]` then `chunk`, in a new buffer. The chunk is copied first — the
/// pass that reads the tensor from memory, which a plain copy does fastest — and its checksum
/// (unless given as `crc`) is then computed over the copy, still in the core's cache.
fn checked_chunk(chunk: &[u8], crc: Option<u32>) -> Bytes {
    let mut out = Vec::with_capacity(8 + chunk.len());
    out.extend_from_slice(&[0; 8]);
    out.extend_from_slice(chunk);
    let crc = crc.unwrap_or_else(|| super::crc::crc32c(&out[8..]));
    out[..8].copy_from_slice(&chunk_prefix(chunk.len(), crc));
    out.into()
}

/// `[u32 LE length][u32 LE crc32c]` of one payload chunk.
fn chunk_prefix(len: usize, crc: u32) -> [u8; 8] {
    let mut prefix = [0u8; 8];
    prefix[..4].copy_from_slice(&(len as u32).to_le_bytes());
    prefix[4..].copy_from_slice(&crc.to_le_bytes());
    prefix
}

/// Where a received message's bytes come from: pieces of the stream in order, each at most as
/// long as asked for, so that a reader never takes bytes past what it needs.
///
/// A QUIC receive stream hands out the buffers its packets were decrypted into
/// (`RecvStream::read_chunk`), so a payload is copied once, from the packet into its
/// destination, after its checksum was computed over the packet's bytes. A byte slice (tests,
/// fuzzing) hands out copies of its front.
pub trait Pieces {
    /// The next bytes of the stream, `1..=max` of them (`max > 0`); `None` at its end.
    fn next_piece(&mut self, max: usize) -> impl std::future::Future<Output = std::io::Result<Option<Bytes>>> + Send;
}

impl Pieces for quinn::RecvStream {
    async fn next_piece(&mut self, max: usize) -> std::io::Result<Option<Bytes>> {
        Ok(self.read_chunk(max, true).await?.map(|c| c.bytes))
    }
}

impl Pieces for &[u8] {
    async fn next_piece(&mut self, max: usize) -> std::io::Result<Option<Bytes>> {
        if self.is_empty() {
            return Ok(None);
        }
        let (front, rest) = self.split_at(max.min(self.len()));
        *self = rest;
        Ok(Some(Bytes::copy_from_slice(front)))
    }
}

/// The next piece of at most `max` bytes, or `Truncated` (naming `what`) at the end of the stream.
async fn piece<R: Pieces>(r: &mut R, max: usize, what: &'static str) -> Result<Bytes, FrameError> {
    match r.next_piece(max).await? {
        Some(p) if !p.is_empty() && p.len() <= max => Ok(p),
        Some(p) if !p.is_empty() => Err(FrameError::Io(std::io::Error::other(format!("a read returned {} bytes, {max} asked", p.len())))),
        _ => Err(FrameError::Truncated { what }),
    }
}

async fn read_exact<R: Pieces>(r: &mut R, buf: &mut [u8], what: &'static str) -> Result<(), FrameError> {
    let mut at = 0;
    while at < buf.len() {
        let p = piece(r, buf.len() - at, what).await?;
        buf[at..at + p.len()].copy_from_slice(&p);
        at += p.len();
    }
    Ok(())
}

async fn read_u32<R: Pieces>(r: &mut R, what: &'static str) -> Result<u32, FrameError> {
    let mut b = [0u8; 4];
    read_exact(r, &mut b, what).await?;
    Ok(u32::from_le_bytes(b))
}

/// Reads one whole message (header, payload, end of stream), validating everything.
pub async fn read_message<R: Pieces>(r: &mut R) -> Result<(Control, Option<Payload>), FrameError> {
    let control = read_header(r).await?;
    let payload = read_body(r, &control).await?;
    Ok((control, payload))
}

/// Reads what follows `control`'s header: the payload of a `Data` message into a new vector,
/// then the end of the stream.
pub async fn read_body<R: Pieces>(r: &mut R, control: &Control) -> Result<Option<Payload>, FrameError> {
    let payload = match control {
        Control::Data { elem, elems, .. } => Some(read_payload(r, *elem, *elems).await?),
        _ => None,
    };
    read_end(r).await?;
    Ok(payload)
}

/// Reads and validates a message's control header; a `Data` payload follows (read it with
/// [`read_body`], [`read_payload_into`], [`read_payload_visit`] or [`read_payload_vec`]).
pub async fn read_header<R: Pieces>(r: &mut R) -> Result<Control, FrameError> {
    let header_len = read_u32(r, "the header length").await? as usize;
    if header_len > FRAME_BYTES_MAX {
        return Err(FrameError::Oversized { what: "control header", bytes: header_len as u64, limit: FRAME_BYTES_MAX as u64 });
    }
    let mut header = AlignedVec::<16>::with_capacity(header_len);
    while header.len() < header_len {
        header.extend_from_slice(&piece(r, header_len - header.len(), "the control header").await?);
    }
    decode_aligned(&header)
}

/// Checks that the stream ends here (any further byte is an error).
pub async fn read_end<R: Pieces>(r: &mut R) -> Result<(), FrameError> {
    match r.next_piece(64).await? {
        None => Ok(()),
        Some(p) => Err(FrameError::Trailing { extra: p.len() }),
    }
}

async fn read_payload<R: Pieces>(r: &mut R, elem: u8, elems: u64) -> Result<Payload, FrameError> {
    match elem {
        ELEM_F32 => Ok(Payload::F32(read_chunks_vec(r, elems).await?)),
        ELEM_F64 => Ok(Payload::F64(read_chunks_vec(r, elems).await?)),
        _ => Err(FrameError::Malformed { detail: format!("unknown element type {elem}") }),
    }
}

/// Reads a payload of exactly `dest.len()` values straight into `dest`, then the end of the stream;
/// each chunk's length and checksum go to `sums`, if given (after what it holds). The caller has
/// checked the header's element type and count against `dest`. A chunk lands in `dest` only
/// after its checksum passed.
pub async fn read_payload_into<R: Pieces, T: bytemuck::Pod>(
    r: &mut R,
    dest: &mut [T],
    sums: Option<&mut Vec<ChunkSum>>,
) -> Result<(), FrameError> {
    read_chunks::<_, T, _>(r, dest.len(), &mut IntoSlice(bytemuck::cast_slice_mut(dest)), sums).await?;
    read_end(r).await
}

/// Reads a payload of `elems` values chunk by chunk through `buf` (at most one chunk in memory,
/// reused across calls), handing each checked chunk to `f(offset, values)`; then the end of the stream.
pub async fn read_payload_visit<R: Pieces, T: bytemuck::Pod>(
    r: &mut R,
    elems: usize,
    buf: &mut Vec<T>,
    f: impl FnMut(usize, &[T]),
) -> Result<(), FrameError> {
    read_chunks(r, elems, &mut Visit { buf, f }, None).await?;
    read_end(r).await
}

/// Adds a payload of exactly `dest.len()` values into `dest` (`dest[i] += value i`), straight
/// from the received packets' buffers (no copy of the values), each chunk once its checksum
/// passed; then the end of the stream. The caller has checked the header against `dest`.
pub async fn read_payload_add<R: Pieces, T: bytemuck::Pod + std::ops::AddAssign>(r: &mut R, dest: &mut [T]) -> Result<(), FrameError> {
    read_chunks(r, dest.len(), &mut AddInto(dest), None).await?;
    read_end(r).await
}

/// Reads a payload of `elems` values into a new vector (bounded by [`MESSAGE_BYTES_MAX`]), then
/// the end of the stream.
pub async fn read_payload_vec<R: Pieces, T: bytemuck::Pod>(r: &mut R, elems: u64) -> Result<Vec<T>, FrameError> {
    let v = read_chunks_vec(r, elems).await?;
    read_end(r).await?;
    Ok(v)
}

/// How many elements to reserve before the first chunk of a `total_bytes` payload arrives.
fn reserve_elems(total_bytes: usize, size: usize) -> usize {
    total_bytes.min(PREALLOC_BYTES_MAX) / size
}

/// Reads `elems` values of `T` into a new (aligned) vector. It grows only as chunks arrive (at
/// most [`PREALLOC_BYTES_MAX`] reserved up front), so a header announcing a huge payload cannot
/// make the receiver allocate memory it never fills; its memory is written once, by the copy
/// from the packets (never zero-filled first).
async fn read_chunks_vec<R: Pieces, T: bytemuck::Pod>(r: &mut R, elems: u64) -> Result<Vec<T>, FrameError> {
    let size = std::mem::size_of::<T>();
    let total = elems.saturating_mul(size as u64);
    if total > MESSAGE_BYTES_MAX {
        return Err(FrameError::Oversized { what: "payload", bytes: total, limit: MESSAGE_BYTES_MAX });
    }
    let mut grow = Grow(Vec::with_capacity(reserve_elems(total as usize, size)));
    read_chunks(r, elems as usize, &mut grow, None).await?;
    Ok(grow.0)
}

/// Where the checked chunks of a payload land.
trait Sink<T> {
    /// The chunk of `n` values starting at value `at` of the payload has arrived, as `pieces`
    /// (`n × size_of::<T>()` bytes in all), and passed its checksum.
    fn put(&mut self, at: usize, n: usize, pieces: &[Bytes]);
}

/// Copies `pieces` one after the other into `dest`, which is exactly as long as all of them.
fn copy_pieces(dest: &mut [u8], pieces: &[Bytes]) {
    let mut at = 0;
    for p in pieces {
        dest[at..at + p.len()].copy_from_slice(p);
        at += p.len();
    }
}

/// The payload's bytes land in a caller's tensor (as bytes).
struct IntoSlice<'a>(&'a mut [u8]);

impl<T: bytemuck::Pod> Sink<T> for IntoSlice<'_> {
    fn put(&mut self, at: usize, n: usize, pieces: &[Bytes]) {
        let size = std::mem::size_of::<T>();
        copy_pieces(&mut self.0[at * size..(at + n) * size], pieces);
    }
}

struct Grow<T>(Vec<T>);

impl<T: bytemuck::Pod> Sink<T> for Grow<T> {
    fn put(&mut self, at: usize, n: usize, pieces: &[Bytes]) {
        let size = std::mem::size_of::<T>();
        assert_eq!(at, self.0.len(), "chunks arrive in order");
        assert_eq!(pieces.iter().map(Bytes::len).sum::<usize>(), n * size, "a chunk's pieces hold exactly its values");
        self.0.reserve(n);
        let dest = self.0.spare_capacity_mut().as_mut_ptr().cast::<u8>();
        let mut off = 0;
        for p in pieces {
            // SAFETY: `reserve(n)` left room for `n` values (`n × size` bytes) after the length;
            // the pieces add up to exactly that (asserted above), and they do not overlap the
            // vector's own allocation.
            unsafe { std::ptr::copy_nonoverlapping(p.as_ptr(), dest.add(off), p.len()) };
            off += p.len();
        }
        // SAFETY: the `n` values after the old length were just written in full, and every bit
        // pattern is a valid `T` (Pod).
        unsafe { self.0.set_len(at + n) };
    }
}

struct Visit<'a, T, F> {
    buf: &'a mut Vec<T>,
    f: F,
}

impl<T: bytemuck::Pod, F: FnMut(usize, &[T])> Sink<T> for Visit<'_, T, F> {
    fn put(&mut self, at: usize, n: usize, pieces: &[Bytes]) {
        // Values are handed on aligned: the pieces are copied into the reused buffer (which
        // stays in cache), zero-filled only where it grows.
        self.buf.truncate(n);
        self.buf.resize(n, T::zeroed());
        copy_pieces(bytemuck::cast_slice_mut(&mut self.buf[..]), pieces);
        (self.f)(at, &self.buf[..n]);
    }
}

/// Adds each chunk's values into a caller's tensor, reading them unaligned from the pieces (a
/// value cut between two pieces is put together first).
struct AddInto<'a, T>(&'a mut [T]);

impl<T: bytemuck::Pod + std::ops::AddAssign> Sink<T> for AddInto<'_, T> {
    fn put(&mut self, at: usize, n: usize, pieces: &[Bytes]) {
        let size = std::mem::size_of::<T>();
        let dest = &mut self.0[at..at + n];
        let (mut i, mut cut, mut have) = (0usize, [0u8; 16], 0usize);
        debug_assert!(size <= cut.len());
        for p in pieces {
            let mut b: &[u8] = p;
            if have > 0 {
                let take = (size - have).min(b.len());
                cut[have..have + take].copy_from_slice(&b[..take]);
                (have, b) = (have + take, &b[take..]);
                if have < size {
                    continue;
                }
                dest[i] += bytemuck::pod_read_unaligned(&cut[..size]);
                i += 1; // `have` is set below, from what is left of this piece
            }
            let whole = b.len() / size;
            for (d, x) in dest[i..i + whole].iter_mut().zip(b.chunks_exact(size)) {
                *d += bytemuck::pod_read_unaligned(x);
            }
            i += whole;
            let rest = &b[whole * size..];
            cut[..rest.len()].copy_from_slice(rest);
            have = rest.len();
        }
        debug_assert!(i == n && have == 0, "a chunk's pieces hold exactly its values");
    }
}

/// Reads the checksummed chunks of a payload of `elems` values of `T` into `sink`. Every chunk
/// is validated (non-empty, ≤ [`CHUNK_BYTES_MAX`], within the announced size, whole values)
/// before a byte of it is read, and its checksum — computed over the received pieces as they
/// arrive — before it is handed on. Each checked chunk's [`ChunkSum`] goes to `sums`, if given.
async fn read_chunks<R: Pieces, T: bytemuck::Pod, S: Sink<T>>(
    r: &mut R,
    elems: usize,
    sink: &mut S,
    mut sums: Option<&mut Vec<ChunkSum>>,
) -> Result<(), FrameError> {
    let size = std::mem::size_of::<T>();
    let (mut at, mut index) = (0usize, 0u64);
    let mut pieces: Vec<Bytes> = Vec::new();
    while at < elems {
        let len = read_u32(r, "a chunk length").await? as usize;
        let want = read_u32(r, "a chunk checksum").await?;
        let left = (elems - at) * size;
        if len == 0 || len > CHUNK_BYTES_MAX || len > left || !len.is_multiple_of(size) {
            let detail = format!("length {len} (limit {CHUNK_BYTES_MAX}, {left} bytes left, element size {size})");
            return Err(FrameError::BadChunk { index, detail });
        }
        pieces.clear();
        let (mut got, mut crc) = (0usize, 0u32);
        while got < len {
            let p = piece(r, len - got, "a chunk").await?;
            crc = super::crc::crc32c_append(crc, &p);
            got += p.len();
            pieces.push(p);
        }
        if crc != want {
            return Err(FrameError::Checksum { index, got: crc, want });
        }
        if let Some(sums) = sums.as_deref_mut() {
            sums.push(ChunkSum { len: len as u32, crc });
        }
        let n = len / size;
        sink.put(at, n, &pieces);
        at += n;
        index += 1;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block_on<F: std::future::Future>(f: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread().build().expect("runtime").block_on(f)
    }

    fn encode(control: &Control, payload: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        block_on(write_message(&mut out, control, payload)).expect("write to a Vec");
        out
    }

    fn decode(mut bytes: &[u8]) -> Result<(Control, Option<Payload>), FrameError> {
        block_on(read_message(&mut bytes))
    }

    fn data_message(n: usize) -> (Control, Vec<f32>, Vec<u8>) {
        let v: Vec<f32> = (0..n).map(|i| i as f32 * 0.5 - 3.0).collect();
        let c = Control::Data { key: Key::Coll { seq: 7, step: 2 }, elem: ELEM_F32, elems: n as u64 };
        let wire = encode(&c, bytemuck::cast_slice(&v));
        (c, v, wire)
    }

    #[test]
    fn round_trips_controls_and_multi_chunk_payloads() {
        let n = CHUNK_BYTES_MAX / 4 * 2 + 3; // three chunks, the last partial
        let (c, v, wire) = data_message(n);
        assert_eq!(decode(&wire).unwrap(), (c, Some(Payload::F32(v))));
        let d = Control::Desc { seq: 3, desc: OpDesc { op: 2, lens: vec![10, 5], ends: vec![3, 10], lanes: 3 } };
        assert_eq!(decode(&encode(&d, &[])).unwrap(), (d, None));
        let f = Control::Data { key: Key::P2p { tag: 9, n: 0 }, elem: ELEM_F64, elems: 2 };
        let x = [1.5f64, -0.0];
        assert_eq!(decode(&encode(&f, bytemuck::cast_slice(&x))).unwrap().1, Some(Payload::F64(x.to_vec())));
    }

    #[test]
    fn truncated_messages_are_rejected_at_every_cut() {
        let (_, _, wire) = data_message(300);
        for cut in [0, 2, 4, 10, wire.len() - 1201, wire.len() - 1] {
            let err = decode(&wire[..cut]).unwrap_err();
            assert!(matches!(err, FrameError::Truncated { .. } | FrameError::Malformed { .. }), "cut {cut}: {err}");
        }
    }

    #[test]
    fn garbage_headers_are_rejected_without_panicking() {
        let mut rng = tessera_kernels::tensor::Rng::new(5);
        for len in [0usize, 1, 3, 8, 17, 64, 300] {
            for _ in 0..50 {
                let junk: Vec<u8> = (0..len).map(|_| (rng.next_u64() & 0xff) as u8).collect();
                let mut wire = (len as u32).to_le_bytes().to_vec();
                wire.extend_from_slice(&junk);
                // Either rejected or (rarely) a valid message; never a panic.
                let _ = decode(&wire);
            }
        }
        let mut wire = 4u32.to_le_bytes().to_vec();
        wire.extend_from_slice(&[0xff; 4]);
        assert!(matches!(decode(&wire), Err(FrameError::Malformed { .. })));
    }

    #[test]
    fn oversized_frames_are_rejected_before_allocation() {
        let wire = ((FRAME_BYTES_MAX + 1) as u32).to_le_bytes();
        assert!(matches!(decode(&wire), Err(FrameError::Oversized { what: "control header", .. })));
        let huge = Control::Data { key: Key::Desc { seq: 0 }, elem: ELEM_F64, elems: MESSAGE_BYTES_MAX };
        assert!(matches!(decode(&encode(&huge, &[])), Err(FrameError::Oversized { what: "payload", .. })));
        let (_, _, mut wire) = data_message(4);
        let at = wire.len() - 16 - 8; // the chunk length field
        wire[at..at + 4].copy_from_slice(&((CHUNK_BYTES_MAX + 4) as u32).to_le_bytes());
        assert!(matches!(decode(&wire), Err(FrameError::BadChunk { .. })));
    }

    #[test]
    fn corrupt_chunks_and_trailing_bytes_are_rejected() {
        let (_, _, wire) = data_message(4);
        let mut flipped = wire.clone();
        *flipped.last_mut().unwrap() ^= 1;
        assert!(matches!(decode(&flipped), Err(FrameError::Checksum { index: 0, .. })));
        let mut longer = wire.clone();
        longer.push(0);
        assert!(matches!(decode(&longer), Err(FrameError::Trailing { extra: 1 })));
        let bad_elem = Control::Data { key: Key::Desc { seq: 0 }, elem: 9, elems: 1 };
        assert!(matches!(decode(&encode(&bad_elem, &[0; 4])), Err(FrameError::Malformed { .. })));
    }

    /// Splits a wire message after its header, as a receiver that reads the header first sees it.
    fn after_header(wire: &[u8]) -> (Control, &[u8]) {
        let mut r = wire;
        let control = block_on(read_header(&mut r)).expect("a valid header");
        (control, r)
    }

    #[test]
    fn payloads_read_into_place_and_by_chunk_match_the_sent_values() {
        let n = SEND_CHUNK_BYTES / 4 * 5 + 7; // six chunks, the last partial
        let (_, v, wire) = data_message(n);
        let (_, mut body) = after_header(&wire);
        let mut dest = vec![0f32; n];
        block_on(read_payload_into(&mut body, &mut dest, None)).unwrap();
        assert_eq!(dest, v);

        let (_, mut body) = after_header(&wire);
        let (mut seen, mut chunk) = (vec![f32::NAN; n], Vec::new());
        let mut pieces = 0;
        block_on(read_payload_visit(&mut body, n, &mut chunk, |at, x| {
            seen[at..at + x.len()].copy_from_slice(x);
            pieces += 1;
        }))
        .unwrap();
        assert_eq!((seen, pieces), (v.clone(), 6));
        assert!(chunk.len() <= CHUNK_BYTES_MAX / 4);

        let (_, mut body) = after_header(&wire);
        assert_eq!(block_on(read_payload_vec::<_, f32>(&mut body, n as u64)).unwrap(), v);
    }

    /// A stream that hands out pieces of odd sizes (as QUIC does: one per packet, cut anywhere).
    struct Dribble<'a>(&'a [u8], usize);

    impl Pieces for Dribble<'_> {
        async fn next_piece(&mut self, max: usize) -> std::io::Result<Option<Bytes>> {
            const SIZES: [usize; 6] = [1, 3, 7, 64, 1000, 65_000];
            self.1 += 1;
            let mut front = &self.0[..self.0.len().min(SIZES[self.1 % SIZES.len()])];
            let got = front.next_piece(max).await?;
            self.0 = &self.0[got.as_ref().map_or(0, Bytes::len)..];
            Ok(got)
        }
    }

    #[test]
    fn payloads_cut_into_odd_pieces_land_whole_in_every_sink() {
        let n = SEND_CHUNK_BYTES / 4 * 2 + 5;
        let (c, v, wire) = data_message(n);
        assert_eq!(block_on(read_message(&mut Dribble(&wire, 0))).unwrap(), (c, Some(Payload::F32(v.clone()))));
        let mut r = Dribble(&wire, 1);
        block_on(read_header(&mut r)).unwrap();
        let mut dest = vec![0f32; n];
        block_on(read_payload_into(&mut r, &mut dest, None)).unwrap();
        assert_eq!(dest, v);
        let mut r = Dribble(&wire, 2);
        block_on(read_header(&mut r)).unwrap();
        let (mut seen, mut chunk) = (vec![f32::NAN; n], vec![9.0; 3]);
        block_on(read_payload_visit(&mut r, n, &mut chunk, |at, x| seen[at..at + x.len()].copy_from_slice(x))).unwrap();
        assert_eq!(seen, v);
        let mut r = Dribble(&wire, 4);
        block_on(read_header(&mut r)).unwrap();
        let mut sum: Vec<f32> = (0..n).map(|i| i as f32).collect();
        block_on(read_payload_add(&mut r, &mut sum)).unwrap();
        assert!(sum.iter().zip(&v).enumerate().all(|(i, (&s, &x))| s.to_bits() == (i as f32 + x).to_bits()));
        let f64s: Vec<f64> = (0..1000).map(|i| i as f64 * 0.25 - 7.0).collect();
        let c64 = Control::Data { key: Key::Coll { seq: 1, step: 0 }, elem: ELEM_F64, elems: 1000 };
        let wire64 = encode(&c64, bytemuck::cast_slice(&f64s));
        let mut r = Dribble(&wire64, 0);
        block_on(read_header(&mut r)).unwrap();
        let mut sum64 = vec![1.0f64; 1000];
        block_on(read_payload_add(&mut r, &mut sum64)).unwrap();
        assert!(sum64.iter().zip(&f64s).all(|(&s, &x)| s.to_bits() == (1.0 + x).to_bits()));
        let mut flipped = wire.clone();
        flipped[wire.len() - 100] ^= 4; // in the second chunk (the third is 28 bytes)
        assert!(matches!(block_on(read_message(&mut Dribble(&flipped, 3))), Err(FrameError::Checksum { index: 1, .. })));
    }

    #[test]
    fn payloads_read_into_place_are_still_validated() {
        let (_, _, wire) = data_message(SEND_CHUNK_BYTES / 4 + 3);
        let mut flipped = wire.clone();
        *flipped.last_mut().unwrap() ^= 0x80;
        let (_, mut body) = after_header(&flipped);
        let mut dest = vec![0f32; SEND_CHUNK_BYTES / 4 + 3];
        assert!(matches!(block_on(read_payload_into(&mut body, &mut dest, None)), Err(FrameError::Checksum { index: 1, .. })));
        // The failing chunk never landed: only the first one did.
        assert!(dest[SEND_CHUNK_BYTES / 4..].iter().all(|&x| x == 0.0));
        let mut longer = wire.clone();
        longer.extend_from_slice(&[1, 2]);
        let (_, mut body) = after_header(&longer);
        assert!(matches!(block_on(read_payload_into(&mut body, &mut dest, None)), Err(FrameError::Trailing { extra: 2 })));
        let (_, mut body) = after_header(&wire[..wire.len() - 5]);
        assert!(matches!(block_on(read_payload_into(&mut body, &mut dest, None)), Err(FrameError::Truncated { .. })));
        // A chunk longer than what is left of the payload is refused before it is read.
        let (_, mut body) = after_header(&wire);
        let mut short = vec![0f32; 10];
        assert!(matches!(block_on(read_payload_into(&mut body, &mut short, None)), Err(FrameError::BadChunk { index: 0, .. })));
        let (_, mut body) = after_header(&wire);
        let huge = MESSAGE_BYTES_MAX / 4 + 1;
        assert!(matches!(block_on(read_payload_vec::<_, f32>(&mut body, huge)), Err(FrameError::Oversized { .. })));
    }

    /// Counts the buffers a message takes.
    struct CountingWriter(Vec<u8>, usize);

    impl Sends for CountingWriter {
        async fn send(&mut self, bytes: Bytes) -> std::io::Result<()> {
            self.0.extend_from_slice(&bytes);
            self.1 += 1;
            Ok(())
        }

        async fn send_all(&mut self, parts: &mut [Bytes]) -> std::io::Result<()> {
            parts.iter().for_each(|p| self.0.extend_from_slice(p));
            self.1 += 1;
            Ok(())
        }
    }

    /// Lends by copying, and counts the pieces lent.
    struct CountingLend(std::sync::atomic::AtomicUsize);

    impl Lend<'_> for CountingLend {
        fn lend(&self, bytes: &[u8]) -> Bytes {
            self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            Bytes::copy_from_slice(bytes)
        }
    }

    #[test]
    fn lent_chunks_and_forwarded_checksums_go_out_as_a_copied_message_would() {
        let (c, v, wire) = data_message(SEND_CHUNK_BYTES / 4 * 3 + 5);
        let payload: &[u8] = bytemuck::cast_slice(&v);
        let write = |sums: Option<&[ChunkSum]>| {
            let lend = CountingLend(0.into());
            let mut w = CountingWriter(Vec::new(), 0);
            block_on(write_message_with(&mut w, &c, payload, Some(&lend), sums)).unwrap();
            (w.0, w.1, lend.0.into_inner())
        };
        assert_eq!(write(None), (wire.clone(), 1 + 4, 3), "the header, three lent chunks and the last one copied");
        // What a receiver records is what the sender computed: forwarded, it gives the same wire.
        let (_, mut body) = after_header(&wire);
        let (mut dest, mut sums) = (vec![0f32; v.len()], Vec::new());
        block_on(read_payload_into(&mut body, &mut dest, Some(&mut sums))).unwrap();
        assert_eq!((dest == v, sums.len()), (true, 4));
        assert_eq!(write(Some(&sums)).0, wire);
        // The sums are sent as they are, not computed again (a wrong one reaches the receiver, which refuses the chunk)...
        let mut wrong = sums.clone();
        wrong[1].crc ^= 1;
        let (bad, _, _) = write(Some(&wrong));
        let (_, mut body) = after_header(&bad);
        assert!(matches!(block_on(read_payload_into(&mut body, &mut dest, None)), Err(FrameError::Checksum { index: 1, .. })));
        // ...unless they do not match the payload's chunks, length for length.
        let mut cut = sums.clone();
        cut[0].len -= 4;
        assert_eq!(write(Some(&cut)).0, wire);
        assert_eq!(write(Some(&wrong[..3])).0, wire);
    }

    #[test]
    fn a_small_message_is_one_write_and_a_large_one_is_chunked() {
        let (c, v, wire) = data_message(16);
        let mut w = CountingWriter(Vec::new(), 0);
        block_on(write_message(&mut w, &c, bytemuck::cast_slice(&v))).unwrap();
        assert_eq!((w.0, w.1), (wire, 1));
        let (c, v, wire) = data_message(SEND_CHUNK_BYTES / 4 * 2 + 1);
        let mut w = CountingWriter(Vec::new(), 0);
        block_on(write_message(&mut w, &c, bytemuck::cast_slice(&v))).unwrap();
        assert_eq!((w.0, w.1), (wire, 1 + 3)); // the header, then each chunk with its prefix
    }

    /// Found by `fuzz/` (quic_frame): a header-only message announcing gigabytes of f32 values made
    /// the receiver allocate gigabytes before reading a single chunk.
    #[test]
    fn a_huge_announced_payload_without_chunks_allocates_little() {
        let huge = Control::Data { key: Key::Coll { seq: 1, step: 0 }, elem: ELEM_F32, elems: MESSAGE_BYTES_MAX / 4 };
        let mut wire = encode(&huge, &[]);
        assert!(matches!(decode(&wire), Err(FrameError::Truncated { what: "a chunk length" })));
        wire.extend_from_slice(&8u32.to_le_bytes());
        wire.extend_from_slice(&crc32c::crc32c(&[0; 8]).to_le_bytes());
        wire.extend_from_slice(&[0; 8]);
        assert!(matches!(decode(&wire), Err(FrameError::Truncated { what: "a chunk length" })));
        assert_eq!(reserve_elems(MESSAGE_BYTES_MAX as usize, 4) * 4, PREALLOC_BYTES_MAX);
        assert_eq!(reserve_elems(12, 4), 3);
    }
}
