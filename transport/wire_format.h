// xdmoe wire format, version 1. The one place the byte layout is defined.
//
// Every message is a ZeroMQ multipart message:
//   frame 0   header, exactly kHeaderSize bytes, little-endian, layout below
//   frame 1   metadata: one msgpack object (often an empty map), meta_len bytes
//   frame 2.. raw tensor frames; their sizes sum to payload_len
// (On a ROUTER socket a routing-id frame precedes frame 0; it is the sender's
// DEALER routing id "w<rank>" and must agree with `src`.)
//
// Header layout (offsets in bytes):
//    0  u32 magic        0x4F4D4458 ("XDMO" read as bytes)
//    4  u8  version      kWireVersion
//    5  u8  kind         MessageKind
//    6  u16 flags        MessageFlags bits; unknown bits must be zero
//    8  u32 job          job id; messages of another job are rejected
//   12  u32 step         training step (or collective sequence number)
//   16  u16 layer        model layer, or 0xFFFF for none
//   18  u16 phase        sub-operation (e.g. Dispatch vs Combine)
//   20  u32 chunk        chunk / round inside one operation
//   24  u16 src          sender rank
//   26  u16 dst          receiver rank
//   28  u32 meta_len     size of frame 1
//   32  u64 payload_len  total size of frames 2..
//   40  end
// A receive matches on (kind, job, step, layer, phase, chunk, src).
//
// Enum values are explicit and only ever appended to.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "common/status.h"

namespace xd {

inline constexpr uint32_t kWireMagic = 0x4F4D4458u;
inline constexpr uint8_t kWireVersion = 1;
inline constexpr size_t kHeaderSize = 40;
inline constexpr uint16_t kNoLayer = 0xFFFF;

enum class MessageKind : uint8_t {
  kHello = 1,          // link set-up
  kHeartbeat = 2,
  kControl = 3,        // e.g. shaping change, stop
  kPointToPoint = 16,
  kAllToAll = 17,
  kAllGather = 18,
  kReduceScatter = 19,
  kAllReduce = 20,
  kBroadcast = 21,
  kBarrier = 22,
  kMoeDispatch = 32,   // tokens to expert owners
  kMoeCombine = 33,    // expert outputs back
  kExpertGather = 34,  // expert weights (HybridEP AG)
  kExpertGrad = 35,    // replica gradients back to owners
  kExpertBase = 36,    // the all-reduce of the SR base experts
};
inline constexpr int kMaxMessageKind = 64;  // counters are indexed by kind

enum MessageFlags : uint16_t {
  kFlagNone = 0,
  // The last tensor frame is a codec payload; the metadata frame is its
  // codec record (compression/codec_format.h).
  kFlagCompressed = 1 << 0,
};
inline constexpr uint16_t kKnownFlags = kFlagCompressed;

const char* message_kind_name(MessageKind k);
bool is_known_kind(uint8_t k);

struct FrameHeader {
  uint8_t version = kWireVersion;
  MessageKind kind = MessageKind::kPointToPoint;
  uint16_t flags = 0;
  uint32_t job = 0;
  uint32_t step = 0;
  uint16_t layer = kNoLayer;
  uint16_t phase = 0;
  uint32_t chunk = 0;
  uint16_t src = 0;
  uint16_t dst = 0;
  uint32_t meta_len = 0;
  uint64_t payload_len = 0;
};

void encode_header(const FrameHeader& h, uint8_t out[kHeaderSize]);
// Checks size, magic, version, kind and flags; the caller checks lengths
// against the frames and src/dst against the link.
Expected<FrameHeader> decode_header(const void* data, size_t size);

enum class RejectReason : int;
// Decodes a header, or says which rule it breaks. Checks size, magic, version,
// kind and flags; the caller checks lengths, sender, destination and job.
bool parse_header(const void* data, size_t size, FrameHeader* out, RejectReason* why);

// Why an incoming message was dropped. Values are stable (counters, logs).
enum class RejectReason : int {
  kTooFewFrames = 0,
  kBadHeaderSize = 1,
  kBadMagic = 2,
  kBadVersion = 3,
  kUnknownKind = 4,
  kUnknownFlags = 5,
  kBadMetaLength = 6,
  kBadPayloadLength = 7,
  kUnknownSender = 8,
  kSenderMismatch = 9,
  kWrongDestination = 10,
  kWrongJob = 11,
  kOversized = 12,
  kBadMetadata = 13,
  kForeignConnection = 14,  // a non-ZMTP or failed handshake, seen by the monitor
};
inline constexpr int kNumRejectReasons = 15;
const char* reject_reason_name(RejectReason r);

}  // namespace xd
