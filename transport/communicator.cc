#include "transport/communicator.h"

#include <algorithm>
#include <cstring>
#include <numeric>

#include "transport/detail/collective_threads.h"

namespace xd {

CollectiveHandle& CollectiveHandle::operator=(CollectiveHandle&& other) {
  if (this != &other) {
    wait();  // the collective still borrows the caller's buffers
    done_ = std::move(other.done_);
  }
  return *this;
}

Status CollectiveHandle::wait() { return done_ ? done_->wait() : Status::ok(); }

namespace {
std::vector<size_t> offsets_of(const std::vector<size_t>& sizes) {
  std::vector<size_t> off(sizes.size() + 1, 0);
  for (size_t i = 0; i < sizes.size(); ++i) off[i + 1] = off[i] + sizes[i];
  return off;
}

// A frame that points into the caller's buffer; the collective waits for its
// Completion before returning, so no owner is needed.
OutFrame borrowed(const void* data, size_t bytes) {
  OutFrame f;
  f.data = data;
  f.size = bytes;
  return f;
}

Status wait_all(std::vector<std::shared_ptr<Completion>>& sends, std::chrono::milliseconds t) {
  Status first;
  for (auto& c : sends) {
    Status st = c->wait(t);
    if (!st.is_ok() && first.is_ok()) first = st;
  }
  sends.clear();
  return first;
}
}  // namespace

Communicator::Communicator(Transport* transport, std::vector<int> ranks,
                           std::chrono::milliseconds timeout)
    : transport_(transport), ranks_(std::move(ranks)), timeout_(timeout) {
  auto it = std::find(ranks_.begin(), ranks_.end(), transport_->rank());
  XD_CHECK_MSG(it != ranks_.end(), "a communicator's group must contain its own rank");
  index_ = static_cast<int>(it - ranks_.begin());
}

size_t Communicator::chunk_count(size_t bytes) const {
  return bytes == 0 ? 1 : (bytes + chunk_bytes_ - 1) / chunk_bytes_;  // an empty block is one empty message
}

void Communicator::set_chunking(size_t chunk_bytes, size_t ring_min_block_bytes) {
  XD_CHECK(chunk_bytes > 0);
  chunk_bytes_ = chunk_bytes;
  ring_min_block_bytes_ = ring_min_block_bytes;
}

Tag Communicator::wire_tag(MessageKind kind, const CollectiveTag& t, uint32_t sub,
                           uint32_t round) const {
  // chunk = sub-operation (8 bits) | round (24 bits), so the steps of one
  // composite collective never match each other.
  return Tag{t.traffic.value_or(kind), t.step, t.layer, t.phase, (sub << 24) | (round & 0xFFFFFF)};
}

Expected<IncomingMessage> Communicator::wait_from(const std::shared_ptr<RecvSlot>& slot,
                                                  int member, const char* what) const {
  auto m = slot->wait(timeout_);
  if (!m) return m.status().with_context(std::string(what) + " from rank " +
                                         std::to_string(ranks_[member]));
  return m;
}

template <typename F>
CollectiveHandle Communicator::launch(F body) {
  return CollectiveHandle(detail::run_collective(std::move(body)));
}

Status Communicator::all_to_allv_now(const CollectiveTag& tag, const void* send,
                                     const std::vector<size_t>& send_bytes, const BlockSink& sink,
                                     MessageKind kind, uint32_t sub) {
  const int n = size();
  if ((int)send_bytes.size() != n) return Status::invalid_argument("all_to_allv: need one size per member");
  const auto soff = offsets_of(send_bytes);
  const uint8_t* s = static_cast<const uint8_t*>(send);
  const Tag t = wire_tag(kind, tag, sub, 0);
  std::vector<std::shared_ptr<RecvSlot>> slots(n);
  for (int i = 0; i < n; ++i)
    if (i != index_) slots[i] = transport_->recv(ranks_[i], t);
  std::vector<std::shared_ptr<Completion>> sends;
  for (int k = 1; k < n; ++k) {  // staggered, so members do not all hit one peer
    const int i = (index_ + k) % n;
    sends.push_back(transport_->send(ranks_[i], t, {borrowed(s + soff[i], send_bytes[i])}));
  }
  // The own block never leaves the process: a loopback message would cost a
  // copy into a ZeroMQ frame and another out of it.
  Status result = sink(index_, s + soff[index_], send_bytes[index_], nullptr);
  for (int k = 1; k < n && result.is_ok(); ++k) {
    const int i = (index_ - k + n) % n;
    auto m = wait_from(slots[i], i, "all_to_allv");
    if (!m) { result = m.status(); break; }
    const size_t got = m->num_tensors() ? m->tensor_size(0) : 0;
    const uint8_t* src = m->num_tensors() ? static_cast<const uint8_t*>(m->tensor_data(0)) : nullptr;
    result = sink(i, src, got, &*m);
  }
  // Sends borrow `send`, so they must finish even when receiving failed.
  Status sent = wait_all(sends, timeout_);
  return result.is_ok() ? sent : result;
}

CollectiveHandle Communicator::all_to_allv(const CollectiveTag& tag, const void* send,
                                           std::vector<size_t> send_bytes, void* recv,
                                           std::vector<size_t> recv_bytes) {
  return launch([=, this, sb = std::move(send_bytes), rb = std::move(recv_bytes)]() -> Status {
    if ((int)rb.size() != size() || (int)sb.size() != size())
      return Status::invalid_argument("all_to_allv: need one size per member");
    if (rb[index_] != sb[index_])
      return Status::invalid_argument("all_to_allv: own block size differs from recv_bytes");
    const auto roff = offsets_of(rb);
    uint8_t* out = static_cast<uint8_t*>(recv);
    return all_to_allv_now(tag, send, sb, [&](int member, const uint8_t* data, size_t bytes, IncomingMessage*) {
      if (bytes != rb[member])
        return Status::invalid_argument("all_to_allv: rank " + std::to_string(ranks_[member]) + " sent " +
                                        std::to_string(bytes) + " bytes, expected " + std::to_string(rb[member]));
      if (bytes) std::memcpy(out + roff[member], data, bytes);
      return Status::ok();
    });
  });
}

CollectiveHandle Communicator::all_to_allv(const CollectiveTag& tag, const void* send,
                                           std::vector<size_t> send_bytes,
                                           std::vector<std::vector<uint8_t>>* recv) {
  return launch([=, this, sb = std::move(send_bytes)] {
    recv->assign(size(), {});
    return all_to_allv_now(tag, send, sb, [recv](int member, const uint8_t* data, size_t bytes, IncomingMessage*) {
      (*recv)[member].assign(data, data + bytes);
      return Status::ok();
    });
  });
}

CollectiveHandle Communicator::all_to_allv(const CollectiveTag& tag, const void* send,
                                           std::vector<size_t> send_bytes, ReceivedBlocks* recv) {
  XD_CHECK_MSG(recv != nullptr, "all_to_allv: null ReceivedBlocks");
  return launch([=, this, sb = std::move(send_bytes)] {
    // Dropping the previous collective's messages first lets ZeroMQ reuse
    // their memory for this one's.
    recv->reset(size());
    Status st = all_to_allv_now(tag, send, sb,
                                [recv](int member, const uint8_t* data, size_t bytes, IncomingMessage* message) {
                                  if (message) recv->set_received(member, std::move(*message));
                                  else recv->set_borrowed(member, data, bytes);
                                  return Status::ok();
                                });
    if (!st.is_ok()) recv->clear();
    return st;
  });
}

void Communicator::send_chunks(int member, MessageKind kind, const CollectiveTag& tag, uint32_t sub,
                               uint32_t round_base, const uint8_t* block, size_t bytes,
                               std::vector<std::shared_ptr<Completion>>* sends) {
  for (size_t c = 0; c < chunk_count(bytes); ++c) {
    const size_t first = std::min(c * chunk_bytes_, bytes);
    sends->push_back(transport_->send(ranks_[member], wire_tag(kind, tag, sub, round_base | uint32_t(c)),
                                      {borrowed(block + first, std::min(chunk_bytes_, bytes - first))}));
  }
}

std::vector<std::shared_ptr<RecvSlot>> Communicator::post_chunks(int member, MessageKind kind,
                                                                 const CollectiveTag& tag, uint32_t sub,
                                                                 uint32_t round_base, size_t bytes) {
  std::vector<std::shared_ptr<RecvSlot>> slots;
  for (size_t c = 0; c < chunk_count(bytes); ++c)
    slots.push_back(transport_->recv(ranks_[member], wire_tag(kind, tag, sub, round_base | uint32_t(c))));
  return slots;
}

Status Communicator::receive_chunks(const std::vector<std::shared_ptr<RecvSlot>>& slots, int member,
                                    uint8_t* block, size_t bytes) {
  size_t filled = 0;
  for (const auto& slot : slots) {
    auto m = wait_from(slot, member, "all_gather");
    if (!m) return m.status();
    const size_t got = m->num_tensors() ? m->tensor_size(0) : 0;
    const size_t want = std::min(chunk_bytes_, bytes - filled);
    if (got != want)
      return Status::invalid_argument("all_gather: rank " + std::to_string(ranks_[member]) + " sent a chunk of " +
                                      std::to_string(got) + " bytes, expected " + std::to_string(want) +
                                      " (block of " + std::to_string(bytes) + " bytes)");
    if (got) std::memcpy(block + filled, m->tensor_data(0), got);
    filled += got;
  }
  return Status::ok();
}

Status Communicator::all_gatherv_now(const CollectiveTag& tag, uint32_t sub, MessageKind kind,
                                     void* data, const std::vector<size_t>& bytes) {
  const int n = size();
  if ((int)bytes.size() != n) return Status::invalid_argument("all_gatherv: need one size per member");
  const auto off = offsets_of(bytes);
  uint8_t* buf = static_cast<uint8_t*>(data);
  const size_t largest = *std::max_element(bytes.begin(), bytes.end());
  // The ring's wire rounds are (round << 12 | chunk).
  if (n > 2 && largest >= ring_min_block_bytes_ && n < 4096 && chunk_count(largest) < 4096)
    return ring_all_gatherv_now(tag, sub, kind, buf, bytes);
  std::vector<std::vector<std::shared_ptr<RecvSlot>>> slots(n);
  for (int i = 0; i < n; ++i)
    if (i != index_) slots[i] = post_chunks(i, kind, tag, sub, 0, bytes[i]);
  std::vector<std::shared_ptr<Completion>> sends;
  for (int k = 1; k < n; ++k)  // staggered, so members do not all hit one peer
    send_chunks((index_ + k) % n, kind, tag, sub, 0, buf + off[index_], bytes[index_], &sends);
  Status result;
  for (int k = 1; k < n && result.is_ok(); ++k) {
    const int i = (index_ - k + n) % n;
    result = receive_chunks(slots[i], i, buf + off[i], bytes[i]);
  }
  Status sent = wait_all(sends, timeout_);
  return result.is_ok() ? sent : result;
}

Status Communicator::ring_all_gatherv_now(const CollectiveTag& tag, uint32_t sub, MessageKind kind,
                                          uint8_t* buf, const std::vector<size_t>& bytes) {
  // Round r sends block (i - r) to the right neighbour and receives block
  // (i - r - 1) from the left, which the next round forwards. Each block is
  // written once and sent only after it is complete, so the borrowed sends
  // never read a block being written.
  const int n = size();
  const auto off = offsets_of(bytes);
  const int right = (index_ + 1) % n, left = (index_ - 1 + n) % n;
  std::vector<std::shared_ptr<Completion>> sends;
  Status result;
  for (int r = 0; r + 1 < n && result.is_ok(); ++r) {
    const int out = ((index_ - r) % n + n) % n, in = ((index_ - r - 1) % n + n) % n;
    const uint32_t base = uint32_t(r) << 12;
    auto slots = post_chunks(left, kind, tag, sub, base, bytes[in]);
    send_chunks(right, kind, tag, sub, base, buf + off[out], bytes[out], &sends);
    result = receive_chunks(slots, left, buf + off[in], bytes[in]);
  }
  Status sent = wait_all(sends, timeout_);
  return result.is_ok() ? sent : result;
}

CollectiveHandle Communicator::all_gatherv(const CollectiveTag& tag, const void* send, void* recv,
                                           std::vector<size_t> recv_bytes) {
  return launch([=, this, rb = std::move(recv_bytes)] {
    const auto off = offsets_of(rb);
    if ((int)rb.size() != size()) return Status::invalid_argument("all_gatherv: need one size per member");
    if (rb[index_] && send != static_cast<uint8_t*>(recv) + off[index_])
      std::memmove(static_cast<uint8_t*>(recv) + off[index_], send, rb[index_]);
    return all_gatherv_now(tag, 0, MessageKind::kAllGather, recv, rb);
  });
}

CollectiveHandle Communicator::all_gather(const CollectiveTag& tag, const void* send, size_t bytes,
                                          void* recv) {
  return all_gatherv(tag, send, recv, std::vector<size_t>(size(), bytes));
}

Status Communicator::reduce_scatter_now(const CollectiveTag& tag, uint32_t sub, float* data,
                                        const std::vector<size_t>& counts) {
  const int n = size();
  if ((int)counts.size() != n) return Status::invalid_argument("reduce_scatter: need one count per member");
  if (n == 1) return Status::ok();
  const auto off = offsets_of(counts);
  const size_t largest = *std::max_element(counts.begin(), counts.end()) * sizeof(float);
  if (n == 2 || largest < ring_min_block_bytes_) {
    // Direct: one all-to-all round in which block j goes to member j, and each
    // member adds the n - 1 partials of its own block as they are taken in
    // (a fixed order per member): a slow link's latency is paid once instead of
    // n - 1 times. The sends read only the other members' blocks; only the own
    // block is written.
    std::vector<size_t> bytes(n);
    for (int i = 0; i < n; ++i) bytes[i] = counts[i] * sizeof(float);
    float* own = data + off[index_];
    return all_to_allv_now(
        tag, data, bytes,
        [&](int member, const uint8_t* block, size_t got, IncomingMessage* message) {
          if (!message) return Status::ok();  // the own partial is already in place
          if (got != bytes[index_])
            return Status::invalid_argument("reduce_scatter: block size mismatch from rank " +
                                            std::to_string(ranks_[member]));
          const float* src = reinterpret_cast<const float*>(block);
          for (size_t j = 0; j < counts[index_]; ++j) own[j] += src[j];
          return Status::ok();
        },
        MessageKind::kReduceScatter, sub);
  }
  // Ring, for large blocks: at round r, member i sends its partial sum of
  // block (i - r - 1) to the right and adds the left neighbour's partial of
  // block (i - r - 2). After n - 1 rounds, block i holds the full sum at
  // member i.
  const int right = (index_ + 1) % n, left = (index_ - 1 + n) % n;
  std::vector<std::shared_ptr<Completion>> sends;
  for (int r = 0; r < n - 1; ++r) {
    const int send_block = ((index_ - r - 1) % n + n) % n;
    const int recv_block = ((index_ - r - 2) % n + n) % n;
    const Tag t = wire_tag(MessageKind::kReduceScatter, tag, sub, r);
    auto slot = transport_->recv(ranks_[left], t);
    sends.push_back(transport_->send(ranks_[right], t,
                                     {borrowed(data + off[send_block], counts[send_block] * sizeof(float))}));
    auto m = wait_from(slot, left, "reduce_scatter");
    if (!m) { wait_all(sends, timeout_); return m.status(); }
    const size_t got = m->num_tensors() ? m->tensor_size(0) : 0;
    if (got != counts[recv_block] * sizeof(float)) {
      wait_all(sends, timeout_);
      return Status::invalid_argument("reduce_scatter: block size mismatch from rank " +
                                      std::to_string(ranks_[left]));
    }
    // The block we add into is sent only in a later round, so no send in
    // flight reads it.
    float* dst = data + off[recv_block];
    const float* src = static_cast<const float*>(m->tensor_data(0));
    for (size_t j = 0; j < counts[recv_block]; ++j) dst[j] += src[j];
  }
  return wait_all(sends, timeout_);
}

CollectiveHandle Communicator::reduce_scatter(const CollectiveTag& tag, const float* data,
                                              std::vector<size_t> counts, float* out) {
  return launch([=, this, c = std::move(counts)] {
    if ((int)c.size() != size()) return Status::invalid_argument("reduce_scatter: need one count per member");
    const auto off = offsets_of(c);
    std::vector<float> work(data, data + off.back());
    Status st = reduce_scatter_now(tag, 0, work.data(), c);
    if (st.is_ok() && c[index_]) std::memcpy(out, work.data() + off[index_], c[index_] * sizeof(float));
    return st;
  });
}

Status Communicator::ring_all_reduce_now(const CollectiveTag& tag, uint32_t sub, float* data,
                                         size_t count) {
  const int n = size();
  if (n == 1) return Status::ok();
  if (one_shot_all_reduce(n, count * sizeof(float))) {
    std::vector<float> all(count * n);
    std::copy(data, data + count, all.begin() + count * index_);
    XD_RETURN_IF_ERROR(all_gatherv_now(tag, 2 * sub + 1, MessageKind::kAllReduce, all.data(),
                                       std::vector<size_t>(n, count * sizeof(float))));
    for (size_t k = 0; k < count; ++k) {
      float sum = all[k];
      for (int i = 1; i < n; ++i) sum += all[i * count + k];
      data[k] = sum;
    }
    return Status::ok();
  }
  std::vector<size_t> counts(n, count / n);
  for (size_t i = 0; i < count % n; ++i) counts[i]++;
  XD_RETURN_IF_ERROR(reduce_scatter_now(tag, 2 * sub, data, counts));
  std::vector<size_t> bytes(n);
  for (int i = 0; i < n; ++i) bytes[i] = counts[i] * sizeof(float);
  return all_gatherv_now(tag, 2 * sub + 1, MessageKind::kAllReduce, data, bytes);
}

CollectiveHandle Communicator::all_reduce(const CollectiveTag& tag, float* data, size_t count) {
  return launch([=, this] { return ring_all_reduce_now(tag, 0, data, count); });
}

CollectiveHandle Communicator::broadcast(const CollectiveTag& tag, void* data, size_t bytes,
                                         int root) {
  return launch([=, this]() -> Status {
    if (root < 0 || root >= size()) return Status::invalid_argument("broadcast: bad root");
    const Tag t = wire_tag(MessageKind::kBroadcast, tag, 0, 0);
    if (index_ == root) {
      std::vector<std::shared_ptr<Completion>> sends;
      for (int i = 0; i < size(); ++i)
        if (i != root) sends.push_back(transport_->send(ranks_[i], t, {borrowed(data, bytes)}));
      return wait_all(sends, timeout_);
    }
    auto m = wait_from(transport_->recv(ranks_[root], t), root, "broadcast");
    if (!m) return m.status();
    const size_t got = m->num_tensors() ? m->tensor_size(0) : 0;
    if (got != bytes) return Status::invalid_argument("broadcast: size mismatch");
    if (got) std::memcpy(data, m->tensor_data(0), got);
    return Status::ok();
  });
}

CollectiveHandle Communicator::barrier(const CollectiveTag& tag) {
  return launch([=, this]() -> Status {
    // Dissemination barrier: ceil(log2 n) rounds of empty messages.
    const int n = size();
    std::vector<std::shared_ptr<Completion>> sends;
    for (int dist = 1, round = 0; dist < n; dist *= 2, ++round) {
      const Tag t = wire_tag(MessageKind::kBarrier, tag, 0, round);
      auto slot = transport_->recv(ranks_[(index_ - dist + n) % n], t);
      sends.push_back(transport_->send(ranks_[(index_ + dist) % n], t, {}));
      auto m = wait_from(slot, (index_ - dist + n) % n, "barrier");
      if (!m) return m.status();
    }
    return wait_all(sends, timeout_);
  });
}

CollectiveHandle hierarchical_all_reduce(Communicator* inner, Communicator* outer,
                                         const CollectiveTag& tag, float* data, size_t count) {
  return CollectiveHandle(detail::run_collective([=] {
    const int n = inner->size();
    std::vector<size_t> counts(n, count / n);
    for (size_t i = 0; i < count % n; ++i) counts[i]++;
    std::vector<size_t> off(n + 1, 0), bytes(n);
    for (int i = 0; i < n; ++i) {
      off[i + 1] = off[i] + counts[i];
      bytes[i] = counts[i] * sizeof(float);
    }
    // Nothing across: the inner group's all-reduce, one round when it pays.
    if (outer->size() == 1) return inner->ring_all_reduce_now(tag, 10, data, count);
    Status st = inner->reduce_scatter_now(tag, 10, data, counts);
    if (st.is_ok()) st = outer->ring_all_reduce_now(tag, 6, data + off[inner->index()], counts[inner->index()]);
    if (st.is_ok()) st = inner->all_gatherv_now(tag, 11, MessageKind::kAllReduce, data, bytes);
    return st;
  }));
}

CollectiveHandle hierarchical_sum(Communicator* inner, Communicator* outer, const CollectiveTag& tag,
                                  double* value) {
  return CollectiveHandle(detail::run_collective([=] {
    for (Communicator* c : {inner, outer}) {
      if (c->size() <= 1) continue;
      std::vector<double> all(c->size());
      XD_RETURN_IF_ERROR(c->all_gather(tag, value, sizeof(double), all.data()).wait());
      double sum = 0;
      for (double v : all) sum += v;
      *value = sum;
    }
    return Status::ok();
  }));
}

std::vector<int> ranks_along_level(const std::vector<int>& level_sizes, int level, int rank) {
  // Location coordinate l of rank m is floor(m / prod_{j>l} SF^j) mod SF^l.
  int stride = 1;
  for (size_t j = level + 1; j < level_sizes.size(); ++j) stride *= level_sizes[j];
  const int coord = (rank / stride) % level_sizes[level];
  const int base = rank - coord * stride;
  std::vector<int> out;
  for (int c = 0; c < level_sizes[level]; ++c) out.push_back(base + c * stride);
  return out;
}

}  // namespace xd
