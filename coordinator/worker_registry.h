// WorkerRegistry: membership and liveness of a job's workers (zguide Paranoid
// Pirate). A worker is alive while now < expiry, where every heartbeat (or any
// message) sets expiry = now + interval x liveness. Ranks are given on
// registration: the requested one if it is free (else an error); without a
// request, the peer's earlier rank or the lowest free one. Pure bookkeeping
// with an injected clock (the caller passes `now`).
// Not thread-safe: the coordinator's loop owns it.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "common/status.h"
#include "cluster/protocol.h"

namespace xd {

enum class WorkerState : int { kRegistered = 0, kRunning = 1, kLost = 2, kDone = 3, kFailed = 4 };
const char* worker_state_name(WorkerState s);

struct WorkerEntry {
  int rank = -1;
  std::string peer_id;  // control routing id
  RegisterRequest info;
  WorkerState state = WorkerState::kRegistered;
  double last_seen = 0, expiry = 0;
  std::optional<StepMetrics> last_metrics;
  std::string error;
};

class WorkerRegistry {
 public:
  WorkerRegistry(int world_size, double heartbeat_interval_s, int liveness);

  // A (re-)registration from `peer_id`. Error when the job is full, the rank
  // is out of range or already taken by a live worker.
  Expected<int> add(const std::string& peer_id, const RegisterRequest& req, double now);
  // Any message from a known peer refreshes its expiry. Returns its rank.
  std::optional<int> touch(const std::string& peer_id, double now);
  // Marks workers whose expiry passed as lost; returns their ranks.
  std::vector<int> expire(double now);

  bool complete() const;  // every rank registered
  int world_size() const { return static_cast<int>(workers_.size()); }
  WorkerEntry* find(int rank);
  const std::vector<std::optional<WorkerEntry>>& workers() const { return workers_; }

 private:
  std::vector<std::optional<WorkerEntry>> workers_;  // by rank
  double interval_;
  int liveness_;
};

}  // namespace xd
