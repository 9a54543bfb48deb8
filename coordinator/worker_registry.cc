#include "coordinator/worker_registry.h"

namespace xd {

const char* worker_state_name(WorkerState s) {
  switch (s) {
    case WorkerState::kRegistered: return "registered";
    case WorkerState::kRunning: return "running";
    case WorkerState::kLost: return "lost";
    case WorkerState::kDone: return "done";
    case WorkerState::kFailed: return "failed";
  }
  return "?";
}

WorkerRegistry::WorkerRegistry(int world_size, double interval, int liveness)
    : workers_(world_size), interval_(interval), liveness_(liveness) {}

Expected<int> WorkerRegistry::add(const std::string& peer_id, const RegisterRequest& req, double now) {
  const int G = world_size();
  int rank = req.requested_rank;
  if (rank >= G) return Status::invalid_argument("requested rank " + std::to_string(rank) +
                                                 " but the job has " + std::to_string(G) + " workers");
  if (rank >= 0 && workers_[rank] && workers_[rank]->peer_id != peer_id &&
      workers_[rank]->state != WorkerState::kLost)
    return Status::invalid_argument("rank " + std::to_string(rank) + " is already taken");
  if (rank < 0) {
    for (int r = 0; r < G && rank < 0; ++r)
      if (workers_[r] && workers_[r]->peer_id == peer_id) rank = r;  // a repeated register
    for (int r = 0; r < G && rank < 0; ++r)
      if (!workers_[r]) rank = r;
    if (rank < 0) return Status::unavailable("the job already has all " + std::to_string(G) + " workers");
  }
  WorkerEntry e;
  e.rank = rank;
  e.peer_id = peer_id;
  e.info = req;
  e.last_seen = now;
  e.expiry = now + interval_ * liveness_;
  workers_[rank] = std::move(e);
  return rank;
}

std::optional<int> WorkerRegistry::touch(const std::string& peer_id, double now) {
  for (auto& w : workers_)
    if (w && w->peer_id == peer_id && w->state != WorkerState::kLost) {
      w->last_seen = now;
      w->expiry = now + interval_ * liveness_;
      return w->rank;
    }
  return std::nullopt;
}

std::vector<int> WorkerRegistry::expire(double now) {
  std::vector<int> lost;
  for (auto& w : workers_)
    if (w && (w->state == WorkerState::kRegistered || w->state == WorkerState::kRunning) &&
        now >= w->expiry) {
      w->state = WorkerState::kLost;
      lost.push_back(w->rank);
    }
  return lost;
}

bool WorkerRegistry::complete() const {
  for (const auto& w : workers_)
    if (!w) return false;
  return true;
}

WorkerEntry* WorkerRegistry::find(int rank) {
  if (rank < 0 || rank >= world_size() || !workers_[rank]) return nullptr;
  return &*workers_[rank];
}

}  // namespace xd
