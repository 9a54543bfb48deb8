// ReceivedBlocks: the blocks of one all_to_allv, read where they landed
// instead of copied into a caller's buffer.
//   * Ownership: it holds the received IncomingMessages, so block i stays
//     readable in ZeroMQ's receive buffer for as long as this object lives
//     (or until a later collective refills it).
//   * The own block (member == the communicator's index()) is not copied: it
//     points into the caller's `send` buffer, so `send` must outlive reading it.
//   * Not thread-safe while a collective fills it: it must outlive that
//     collective, and be read only after its wait() has returned. A failed
//     collective leaves it empty. Members are positions in the group.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "common/check.h"
#include "transport/message.h"

namespace xd {

class ReceivedBlocks {
 public:
  // Members of the group that filled it; 0 before the first collective.
  int size() const { return static_cast<int>(bytes_.size()); }
  // May be null when bytes(member) is 0.
  const uint8_t* data(int member) const {
    XD_CHECK(member >= 0 && member < size());
    return data_[member];
  }
  size_t bytes(int member) const {
    XD_CHECK(member >= 0 && member < size());
    return bytes_[member];
  }
  // Releases the held messages (ZeroMQ's buffers) early.
  void clear() {
    messages_.clear();
    data_.clear();
    bytes_.clear();
  }

 private:
  friend class Communicator;

  void reset(int members) {
    clear();
    messages_.resize(members);
    data_.assign(members, nullptr);
    bytes_.assign(members, 0);
  }
  void set_borrowed(int member, const uint8_t* data, size_t bytes) {
    data_[member] = data;
    bytes_[member] = bytes;
  }
  // The pointer is taken from the stored message, not before storing it:
  // ZeroMQ keeps very small frames inside the message object itself.
  void set_received(int member, IncomingMessage message) {
    const IncomingMessage& held = messages_[member] = std::move(message);
    const bool empty = held.num_tensors() == 0;
    set_borrowed(member, empty ? nullptr : static_cast<const uint8_t*>(held.tensor_data(0)),
                 empty ? 0 : held.tensor_size(0));
  }

  std::vector<IncomingMessage> messages_;
  std::vector<const uint8_t*> data_;
  std::vector<size_t> bytes_;
};

}  // namespace xd
