#include "transport/wire_format.h"

#include <cstring>

namespace xd {

namespace {
template <typename T>
void put(uint8_t* p, T v) {
  for (size_t i = 0; i < sizeof(T); ++i) p[i] = static_cast<uint8_t>(uint64_t(v) >> (8 * i));
}
template <typename T>
T get(const uint8_t* p) {
  uint64_t v = 0;
  for (size_t i = 0; i < sizeof(T); ++i) v |= uint64_t(p[i]) << (8 * i);
  return static_cast<T>(v);
}
}  // namespace

const char* message_kind_name(MessageKind k) {
  switch (k) {
    case MessageKind::kHello: return "hello";
    case MessageKind::kHeartbeat: return "heartbeat";
    case MessageKind::kControl: return "control";
    case MessageKind::kPointToPoint: return "p2p";
    case MessageKind::kAllToAll: return "all_to_all";
    case MessageKind::kAllGather: return "all_gather";
    case MessageKind::kReduceScatter: return "reduce_scatter";
    case MessageKind::kAllReduce: return "all_reduce";
    case MessageKind::kBroadcast: return "broadcast";
    case MessageKind::kBarrier: return "barrier";
    case MessageKind::kMoeDispatch: return "moe_dispatch";
    case MessageKind::kMoeCombine: return "moe_combine";
    case MessageKind::kExpertGather: return "expert_gather";
    case MessageKind::kExpertGrad: return "expert_grad";
    case MessageKind::kExpertBase: return "expert_base";
  }
  return "unknown";
}

bool is_known_kind(uint8_t k) {
  return std::strcmp(message_kind_name(static_cast<MessageKind>(k)), "unknown") != 0;
}

void encode_header(const FrameHeader& h, uint8_t out[kHeaderSize]) {
  put<uint32_t>(out + 0, kWireMagic);
  put<uint8_t>(out + 4, h.version);
  put<uint8_t>(out + 5, static_cast<uint8_t>(h.kind));
  put<uint16_t>(out + 6, h.flags);
  put<uint32_t>(out + 8, h.job);
  put<uint32_t>(out + 12, h.step);
  put<uint16_t>(out + 16, h.layer);
  put<uint16_t>(out + 18, h.phase);
  put<uint32_t>(out + 20, h.chunk);
  put<uint16_t>(out + 24, h.src);
  put<uint16_t>(out + 26, h.dst);
  put<uint32_t>(out + 28, h.meta_len);
  put<uint64_t>(out + 32, h.payload_len);
}

Expected<FrameHeader> decode_header(const void* data, size_t size) {
  if (size != kHeaderSize)
    return Status::corruption("header is " + std::to_string(size) + " bytes, expected " +
                              std::to_string(kHeaderSize));
  const uint8_t* p = static_cast<const uint8_t*>(data);
  if (get<uint32_t>(p) != kWireMagic) return Status::corruption("bad magic");
  FrameHeader h;
  h.version = get<uint8_t>(p + 4);
  if (h.version != kWireVersion)
    return Status::corruption("unsupported wire version " + std::to_string(h.version));
  const uint8_t kind = get<uint8_t>(p + 5);
  if (!is_known_kind(kind)) return Status::corruption("unknown message kind " + std::to_string(kind));
  h.kind = static_cast<MessageKind>(kind);
  h.flags = get<uint16_t>(p + 6);
  if (h.flags & ~kKnownFlags) return Status::corruption("unknown flag bits");
  h.job = get<uint32_t>(p + 8);
  h.step = get<uint32_t>(p + 12);
  h.layer = get<uint16_t>(p + 16);
  h.phase = get<uint16_t>(p + 18);
  h.chunk = get<uint32_t>(p + 20);
  h.src = get<uint16_t>(p + 24);
  h.dst = get<uint16_t>(p + 26);
  h.meta_len = get<uint32_t>(p + 28);
  h.payload_len = get<uint64_t>(p + 32);
  return h;
}

bool parse_header(const void* data, size_t size, FrameHeader* out, RejectReason* why) {
  auto reject = [&](RejectReason r) { *why = r; return false; };
  if (size != kHeaderSize) return reject(RejectReason::kBadHeaderSize);
  const uint8_t* p = static_cast<const uint8_t*>(data);
  if (get<uint32_t>(p) != kWireMagic) return reject(RejectReason::kBadMagic);
  if (get<uint8_t>(p + 4) != kWireVersion) return reject(RejectReason::kBadVersion);
  if (!is_known_kind(get<uint8_t>(p + 5))) return reject(RejectReason::kUnknownKind);
  if (get<uint16_t>(p + 6) & ~kKnownFlags) return reject(RejectReason::kUnknownFlags);
  *out = decode_header(data, size).value();
  return true;
}

const char* reject_reason_name(RejectReason r) {
  static const char* names[kNumRejectReasons] = {
      "too few frames", "bad header size", "bad magic", "bad version", "unknown kind",
      "unknown flags", "bad metadata length", "bad payload length", "unknown sender",
      "sender mismatch", "wrong destination", "wrong job", "oversized", "bad metadata",
      "foreign connection"};
  int i = static_cast<int>(r);
  return i >= 0 && i < kNumRejectReasons ? names[i] : "?";
}

}  // namespace xd
