// Communicator: collectives over a Transport among an ordered group of ranks
// (the whole world, or the ranks along one level of a multilevel layout).
// Every collective starts asynchronously and returns a CollectiveHandle; its
// buffers must stay untouched until wait() returns. Concurrent collectives are
// kept apart by their CollectiveTag, which all members must pass alike.
// Zero-size blocks and ranks with nothing to send are normal cases. A peer
// that never answers turns into a timeout Status, not a hang. Thread-safe.
//
// all_to_allv comes in three forms that move the same messages and differ only
// in where a received block ends up: copied into one caller buffer of known
// layout, copied into one vector per member (sizes not known in advance), or
// left in ZeroMQ's receive buffers and handed over as ReceivedBlocks (sizes
// not known in advance, no copy of any block). The last is the fastest for
// large blocks: the copy out of ZeroMQ's buffers is a third pass over every
// received byte, after the kernel's two.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "common/status.h"
#include "transport/received_blocks.h"
#include "transport/transport.h"

namespace xd {

namespace detail {
class CollectiveCompletion;  // transport/detail/collective_completion.h
}

struct CollectiveTag {
  CollectiveTag(uint32_t step_ = 0, uint16_t layer_ = kNoLayer, uint16_t phase_ = 0,
                std::optional<MessageKind> traffic_ = std::nullopt)
      : step(step_), layer(layer_), phase(phase_), traffic(traffic_) {}
  uint32_t step = 0;
  uint16_t layer = kNoLayer;
  uint16_t phase = 0;
  // When set, every message of the collective carries this kind instead of
  // the collective's own, so its bytes are counted apart (e.g. kExpertBase).
  std::optional<MessageKind> traffic;
};

// The running collective; wait() blocks until it has finished and returns its
// Status. Destroying or overwriting a handle waits too.
class CollectiveHandle {
 public:
  CollectiveHandle() = default;
  explicit CollectiveHandle(std::shared_ptr<detail::CollectiveCompletion> done) : done_(std::move(done)) {}
  CollectiveHandle(CollectiveHandle&&) = default;
  CollectiveHandle& operator=(CollectiveHandle&& other);  // waits for the one it replaces
  ~CollectiveHandle() { wait(); }
  // Blocks until the collective has finished; later calls return the same Status.
  Status wait();

 private:
  std::shared_ptr<detail::CollectiveCompletion> done_;
};

class Communicator {
 public:
  // `ranks` lists the group's members in order; it must contain this rank.
  Communicator(Transport* transport, std::vector<int> ranks,
               std::chrono::milliseconds timeout = std::chrono::seconds(120));

  int size() const { return static_cast<int>(ranks_.size()); }
  int index() const { return index_; }  // this rank's position in the group

  // Block i of `send` (send_bytes[i] bytes, back to back) goes to member i;
  // member i's block lands in `recv` at the running offset of recv_bytes. A
  // block whose size differs from recv_bytes[i] fails the collective.
  CollectiveHandle all_to_allv(const CollectiveTag& tag, const void* send,
                               std::vector<size_t> send_bytes, void* recv,
                               std::vector<size_t> recv_bytes);
  // Same, when receivers do not know the sizes: block i arrives in (*recv)[i].
  CollectiveHandle all_to_allv(const CollectiveTag& tag, const void* send,
                               std::vector<size_t> send_bytes,
                               std::vector<std::vector<uint8_t>>* recv);
  // Same, without copying: *recv keeps the received messages and exposes
  // block i in place (see transport/received_blocks.h); the own block points
  // into `send`. *recv must not be read until wait() returns.
  CollectiveHandle all_to_allv(const CollectiveTag& tag, const void* send,
                               std::vector<size_t> send_bytes, ReceivedBlocks* recv);
  // Member i contributes recv_bytes[i] bytes; everyone gets all, in order.
  CollectiveHandle all_gatherv(const CollectiveTag& tag, const void* send, void* recv,
                               std::vector<size_t> recv_bytes);
  CollectiveHandle all_gather(const CollectiveTag& tag, const void* send, size_t bytes,
                              void* recv);
  // Sums `data` (counts[i] floats for member i, back to back) and leaves the
  // sum of block i in member i's `out` (counts[index()] floats). Direct or
  // ring, see set_chunking().
  CollectiveHandle reduce_scatter(const CollectiveTag& tag, const float* data,
                                  std::vector<size_t> counts, float* out);
  // In-place sum over the group: reduce_scatter, then all_gather.
  CollectiveHandle all_reduce(const CollectiveTag& tag, float* data, size_t count);
  CollectiveHandle broadcast(const CollectiveTag& tag, void* data, size_t bytes, int root_index);
  CollectiveHandle barrier(const CollectiveTag& tag);

  // Blocking forms of the steps above, for use inside other collectives.
  // The all-reduce is one round when one_shot_all_reduce() says so, else a
  // reduce-scatter and an all-gather.
  Status ring_all_reduce_now(const CollectiveTag& tag, uint32_t sub, float* data, size_t count);
  // Whether an all-reduce of `bytes` over `members` runs as one round: every
  // member sends its whole buffer to every other and sums all of them in
  // member order (the same bits everywhere). With two members that moves the
  // bytes of a reduce-scatter plus an all-gather and pays a link's latency
  // once instead of twice; with more, it moves (n - 1) times the buffer
  // instead of 2 (n - 1) / n times, so only up to kOneShotMaxBytes of it.
  // It holds every member's buffer at once, so two members do it up to
  // kOneShotPairMaxBytes (where one latency matters little anyway).
  static bool one_shot_all_reduce(int members, size_t bytes) {
    return (members == 2 && bytes <= kOneShotPairMaxBytes) ||
           (members > 2 && (members - 1) * bytes <= kOneShotMaxBytes);
  }
  static constexpr size_t kOneShotMaxBytes = size_t(64) << 10;
  static constexpr size_t kOneShotPairMaxBytes = size_t(16) << 20;
  Status reduce_scatter_now(const CollectiveTag& tag, uint32_t sub, float* data,
                            const std::vector<size_t>& counts);
  Status all_gatherv_now(const CollectiveTag& tag, uint32_t sub, MessageKind kind, void* data,
                         const std::vector<size_t>& bytes);

  // all_gather(v) moves blocks in messages of at most chunk_bytes (so each
  // buffer ZeroMQ mallocs for a received message stays below glibc's mmap
  // threshold and is reused). all_gather(v) and reduce_scatter (so also
  // all_reduce) send every block straight to its member in one round while
  // the largest block is below ring_min_block_bytes, paying a link's latency
  // once; from there on (and with more than two members) they run as rings:
  // n - 1 rounds to the right neighbour, which bounds the data in flight, and
  // so ZeroMQ's receive buffers, to one block per member. Set before the first
  // collective (not thread-safe against running ones); tests use small values
  // to exercise both paths.
  static constexpr size_t kDefaultChunkBytes = size_t(4) << 20;
  static constexpr size_t kDefaultRingMinBlockBytes = size_t(16) << 20;
  void set_chunking(size_t chunk_bytes, size_t ring_min_block_bytes);

 private:
  template <typename F>
  CollectiveHandle launch(F body);
  Tag wire_tag(MessageKind kind, const CollectiveTag& t, uint32_t sub, uint32_t round) const;
  Expected<IncomingMessage> wait_from(const std::shared_ptr<RecvSlot>& slot, int member,
                                      const char* what) const;
  // Takes block `member` of an all_to_allv: `data` points into the caller's
  // send buffer for the own block (`message` null), else into `*message`,
  // which the sink may keep. A non-ok Status fails the collective.
  using BlockSink = std::function<Status(int member, const uint8_t* data, size_t bytes,
                                         IncomingMessage* message)>;
  // The chunked messages of one all_gather(v) block: wire rounds round_base | chunk.
  size_t chunk_count(size_t bytes) const;
  void send_chunks(int member, MessageKind kind, const CollectiveTag& tag, uint32_t sub, uint32_t round_base,
                   const uint8_t* block, size_t bytes, std::vector<std::shared_ptr<Completion>>* sends);
  std::vector<std::shared_ptr<RecvSlot>> post_chunks(int member, MessageKind kind, const CollectiveTag& tag,
                                                     uint32_t sub, uint32_t round_base, size_t bytes);
  Status receive_chunks(const std::vector<std::shared_ptr<RecvSlot>>& slots, int member, uint8_t* block,
                        size_t bytes);
  Status ring_all_gatherv_now(const CollectiveTag& tag, uint32_t sub, MessageKind kind, uint8_t* buf,
                              const std::vector<size_t>& bytes);
  // The all-to-all round every all_to_allv form (and the direct
  // reduce-scatter) runs; `kind` and `sub` set its wire tag.
  Status all_to_allv_now(const CollectiveTag& tag, const void* send,
                         const std::vector<size_t>& send_bytes, const BlockSink& sink,
                         MessageKind kind = MessageKind::kAllToAll, uint32_t sub = 0);

  Transport* transport_;
  std::vector<int> ranks_;
  int index_ = -1;
  std::chrono::milliseconds timeout_;
  size_t chunk_bytes_ = kDefaultChunkBytes;
  size_t ring_min_block_bytes_ = kDefaultRingMinBlockBytes;
};

// Hierarchical all-reduce for a two-level layout: reduce-scatter inside the
// `inner` group (fast links), all-reduce each shard across `outer` (the ranks at
// the same inner position in the other groups, slow links; one round when
// one_shot_all_reduce() says so), then all-gather inside `inner`. Slow links
// carry 1/|inner| of the data. With `outer` of one member, it is `inner`'s
// all-reduce.
CollectiveHandle hierarchical_all_reduce(Communicator* inner, Communicator* outer,
                                         const CollectiveTag& tag, float* data, size_t count);

// The sum of one double over every rank of a two-level layout, the same bits
// on each: gathered inside `inner` and summed in member order, then the same
// across `outer`. One round per group: a slow link's latency once.
CollectiveHandle hierarchical_sum(Communicator* inner, Communicator* outer, const CollectiveTag& tag,
                                  double* value);

// Ranks that differ from `rank` only in coordinate `level` of a layout whose
// level sizes are `level_sizes` (outermost first), in coordinate order.
std::vector<int> ranks_along_level(const std::vector<int>& level_sizes, int level, int rank);

}  // namespace xd
