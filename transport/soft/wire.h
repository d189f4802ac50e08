// The soft device's wire: what one QP's side writes into shared memory for its peer.
// docs/SOFT_WIRE.md is the readable version of this file; keep them in step.
//
// Each RC QP, once it has a peer, owns one memfd "segment" that only it writes. The peer maps it
// read-only. A segment holds:
//   * a header (written once, before the segment is shared),
//   * the owner's published progress as consumer and responder (one cache line per field),
//   * a request ring (the owner's requests: SEND, RDMA WRITE, READ request, atomics), and
//   * a response ring (the owner's responses to the peer's requests: READ data, atomic results,
//     NAKs).
// Requests and responses use separate rings so that producing a response never waits on the
// peer producing anything: the requester always drains responses, so the two sides cannot
// deadlock on full rings. Acknowledgements for SEND and WRITE need no frame: the responder
// publishes the next MSN it expects (`acked`) and also piggybacks it on every frame it writes.
//
// Frames are 128-byte aligned, never wrap (a PAD frame fills the tail of the ring), and carry a
// stamp, the frame's absolute byte position with the top bit set, stored last with release
// semantics. A consumer polls the stamp at the position it expects next, so one cache-line read
// both detects and orders a new frame, and a stale frame from the previous lap never matches.
//
// Everything a consumer reads from a peer's segment is untrusted: it copies the header out
// before validating it and bounds-checks every length, offset and key against its own state.

#ifndef SWIRL_TRANSPORT_SOFT_WIRE_H_
#define SWIRL_TRANSPORT_SOFT_WIRE_H_

#include <atomic>
#include <cstddef>
#include <cstdint>

#include <cstring>

#if defined(__SANITIZE_THREAD__)
#include <sanitizer/tsan_interface.h>
#endif

namespace swirl::soft::wire {

// ThreadSanitizer cannot see ordering through memory mapped at two addresses (the two ends of a
// pair in one process map the same segment twice), so in TSan builds every publish into a
// segment releases, and every observation of one acquires, one process-wide sync object: a
// deliberate over-approximation that only TSan builds pay for.
#if defined(__SANITIZE_THREAD__)
inline char g_tsan_segment_sync;
inline void SharedRelease() { __tsan_release(&g_tsan_segment_sync); }
inline void SharedAcquire() { __tsan_acquire(&g_tsan_segment_sync); }
#else
inline void SharedRelease() {}
inline void SharedAcquire() {}
#endif

// Places RDMA WRITE data into the application's registered memory. On hardware this is the
// NIC's DMA, which ThreadSanitizer never sees; applications may legitimately read that memory
// while it is written (perftest's write_lat polls the last byte of the buffer), and verbs
// promise nothing about it before the completion. So TSan builds make the placement as
// invisible as the DMA it stands for, and only this copy: the device's own state stays checked.
#if defined(__SANITIZE_THREAD__)
extern "C" void __tsan_ignore_thread_begin();
extern "C" void __tsan_ignore_thread_end();
inline void PlaceRemoteData(void* dst, const void* src, size_t n) {
  __tsan_ignore_thread_begin();
  std::memcpy(dst, src, n);
  __tsan_ignore_thread_end();
}
#else
inline void PlaceRemoteData(void* dst, const void* src, size_t n) { std::memcpy(dst, src, n); }
#endif

// The other direction: reads the application's registered memory for an RDMA READ response,
// the NIC's DMA read on hardware. What orders the application's writes before a peer's READ is
// outside the device (the peer learnt of them over a socket, or from another process), and
// verbs promise nothing to an application that writes memory while a peer reads it; so TSan
// builds make this copy as invisible as that DMA, and only this copy.
#if defined(__SANITIZE_THREAD__)
inline void FetchLocalData(void* dst, const void* src, size_t n) {
  __tsan_ignore_thread_begin();
  std::memcpy(dst, src, n);
  __tsan_ignore_thread_end();
}
#else
inline void FetchLocalData(void* dst, const void* src, size_t n) { std::memcpy(dst, src, n); }
#endif

inline constexpr uint64_t kSegmentMagic = 0x314c525749575331ull;  // "1SWIWRL1"
// 2: frames 128-byte aligned (version 1 had 64); the hello and segment checks refuse a mismatch.
inline constexpr uint32_t kWireVersion = 2;
inline constexpr size_t kCacheLine = 64;
inline constexpr size_t kFrameAlign = 128;
inline constexpr uint64_t kStampValid = uint64_t{1} << 63;
// Largest payload in one frame; larger messages are split into chunks, like MTU packets.
inline constexpr uint32_t kMaxChunk = 32 * 1024;
// Limits a receiver enforces on a peer's segment before mapping it.
inline constexpr uint64_t kMinRingSize = 16 * 1024;
inline constexpr uint64_t kMaxRingSize = 64ull * 1024 * 1024;
inline constexpr uint64_t kMaxSegmentSize = 2 * kMaxRingSize + 64 * 1024;

struct SegmentHeader {
  uint64_t magic;
  uint32_t version;
  uint32_t qp_num;  // the owner's QPN
  uint64_t segment_size;
  uint64_t request_ring_offset;
  uint64_t request_ring_size;
  uint64_t response_ring_offset;
  uint64_t response_ring_size;
  uint64_t reserved;
};
static_assert(sizeof(SegmentHeader) == 64);

// One published 64-bit value on its own cache line.
struct alignas(kCacheLine) Published {
  std::atomic<uint64_t> value;
};
static_assert(sizeof(Published) == kCacheLine);
static_assert(std::atomic<uint64_t>::is_always_lock_free);

enum LinkState : uint64_t {
  kLinkActive = 0,
  kLinkError = 1,   // the owner's QP is in the error state
  kLinkClosed = 2,  // the owner's QP was reset or destroyed
};

// Written by the segment's owner; read by the peer.
struct SegmentControl {
  Published request_consumed;   // bytes of the peer's request ring consumed (absolute)
  Published response_consumed;  // bytes of the peer's response ring consumed (absolute)
  Published acked;              // next request MSN expected: everything before it completed OK
  Published sleeping;           // nonzero: the owner sleeps; write its wake eventfd after posting
  Published state;              // LinkState
};
static_assert(sizeof(SegmentControl) == 5 * kCacheLine);

inline constexpr uint64_t kControlOffset = sizeof(SegmentHeader);
inline constexpr uint64_t kRingsOffset = 4096;
static_assert(kControlOffset + sizeof(SegmentControl) <= kRingsOffset);

enum Op : uint8_t {
  kOpPad = 1,  // the rest of the ring up to its end is unused; continue at offset 0
  // Requests (request ring).
  kOpSend = 2,         // one chunk of a SEND
  kOpWrite = 3,        // one chunk of an RDMA WRITE (carries a RemoteExtension)
  kOpReadRequest = 4,  // RDMA READ request (RemoteExtension, no payload)
  kOpCompareSwap = 5,  // atomic compare-and-swap (RemoteExtension)
  kOpFetchAdd = 6,     // atomic fetch-and-add (RemoteExtension)
  // Responses (response ring).
  kOpReadResponse = 16,    // one chunk of READ data; `total_length` is its offset in the READ
  kOpAtomicResponse = 17,  // 8-byte payload: the original value
  kOpNak = 18,             // `imm_or_inv`: the ibv_wc_status the requester completes with
};

enum FrameFlag : uint8_t {
  kFlagFirst = 1 << 0,     // first chunk of a message
  kFlagLast = 1 << 1,      // last chunk of a message
  kFlagWithImm = 1 << 2,   // SEND/WRITE with immediate (last chunk carries it)
  kFlagWithInv = 1 << 3,   // SEND with invalidate (last chunk carries the rkey)
  kFlagSolicited = 1 << 4, // solicited event (last chunk)
  kFlagsAll = 0x1f,
};

struct FrameHeader {
  uint64_t stamp;         // kStampValid | absolute position; stored last, with release
  uint8_t op;             // Op
  uint8_t flags;          // FrameFlag bits
  uint8_t rnr_retry;      // requests: the requester's rnr_retry (7 = forever)
  uint8_t reserved;
  uint32_t length;        // payload bytes after the header (and extension)
  uint32_t msn;           // requests: this message's MSN; responses: the request's MSN
  uint32_t ack;           // piggybacked SegmentControl::acked of the writer
  uint32_t imm_or_inv;    // immediate (network order, opaque) / rkey to invalidate / NAK status
  uint32_t total_length;  // first chunk of SEND/WRITE: message length; READ response: offset
};
static_assert(sizeof(FrameHeader) == 32);

struct RemoteExtension {
  uint64_t remote_addr;  // WRITE: address of this chunk; READ/atomics: target address
  uint32_t rkey;
  uint32_t length;       // READ: bytes requested
  uint64_t compare_add;  // atomics
  uint64_t swap;
};
static_assert(sizeof(RemoteExtension) == 32);

inline constexpr bool HasRemoteExtension(uint8_t op) {
  return op == kOpWrite || op == kOpReadRequest || op == kOpCompareSwap || op == kOpFetchAdd;
}
inline constexpr bool IsRequestOp(uint8_t op) {
  return op == kOpPad || op == kOpSend || op == kOpWrite || op == kOpReadRequest ||
         op == kOpCompareSwap || op == kOpFetchAdd;
}
inline constexpr bool IsResponseOp(uint8_t op) {
  return op == kOpPad || op == kOpReadResponse || op == kOpAtomicResponse || op == kOpNak;
}

inline constexpr uint64_t AlignFrame(uint64_t bytes) {
  return (bytes + kFrameAlign - 1) & ~uint64_t{kFrameAlign - 1};
}
inline constexpr uint64_t FrameBytes(uint8_t op, uint32_t payload) {
  return AlignFrame(sizeof(FrameHeader) + (HasRemoteExtension(op) ? sizeof(RemoteExtension) : 0) +
                    payload);
}

// 24-bit MSN arithmetic, as IB PSNs: a < b when b is ahead within half the space.
inline constexpr uint32_t kMsnMask = 0xffffff;
inline constexpr uint32_t NextMsn(uint32_t msn) { return (msn + 1) & kMsnMask; }
inline constexpr bool MsnBefore(uint32_t a, uint32_t b) {
  return a != b && ((b - a) & kMsnMask) < (1u << 23);
}

}  // namespace swirl::soft::wire

#endif  // SWIRL_TRANSPORT_SOFT_WIRE_H_
