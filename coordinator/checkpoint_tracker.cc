#include "coordinator/checkpoint_tracker.h"

#include <filesystem>

namespace xd {

Expected<std::optional<CompletedCheckpoint>> CheckpointTracker::record(int rank, const CheckpointSaved& report,
                                                                       double loss) {
  if (rank < 0 || rank >= world_) return Status::invalid_argument("checkpoint report from unknown rank " + std::to_string(rank));
  // The coordinator writes only where the job's checkpoints belong.
  const std::string dir = root_ + "/" + checkpoint_dir_name(report.step);
  if (root_.empty() || report.step < 1 || report.step > steps_ || report.dir != dir ||
      report.file != shard_file_name(rank, world_))
    return Status::invalid_argument("worker " + std::to_string(rank) + " reported shard " + report.file + " of step " +
                                    std::to_string(report.step) + " in " + report.dir + "; expected " +
                                    shard_file_name(rank, world_) + " in " + dir);
  Pending& p = pending_[report.step];
  if (p.seen.empty()) {
    p.seen.assign(world_, false);
    p.dir = report.dir;
    p.data_position = report.data_position;
    // A manifest left by an earlier run at this step describes other shards.
    std::error_code ec;
    std::filesystem::remove(dir + "/" + kManifestFile, ec);
  }
  if (p.seen[rank]) return Status::invalid_argument("worker " + std::to_string(rank) + " reported its shard of step " +
                                                    std::to_string(report.step) + " twice");
  if (report.dir != p.dir || report.data_position != p.data_position)
    return Status::invalid_argument("worker " + std::to_string(rank) + " wrote step " + std::to_string(report.step) +
                                    " to " + report.dir + " at data position " + std::to_string(report.data_position) +
                                    ", others to " + p.dir + " at " + std::to_string(p.data_position));
  p.seen[rank] = true;
  p.shards.push_back({rank, report.file, report.bytes, report.crc32c});
  p.write_s = std::max(p.write_s, report.seconds);
  if (static_cast<int>(p.shards.size()) < world_) return std::optional<CompletedCheckpoint>();
  TrainerState trainer;
  trainer.step = report.step;
  trainer.data_position = p.data_position;
  trainer.seed = seed_;
  trainer.last_loss = loss;
  Pending done = std::move(p);
  pending_.erase(report.step);
  XD_RETURN_IF_ERROR(write_checkpoint_manifest(done.dir, config_, world_, trainer, done.shards));
  CompletedCheckpoint c{report.step, done.dir, 0, done.write_s};
  for (const ShardRecord& s : done.shards) c.bytes += s.bytes;
  completed_.push_back(c);
  return std::optional<CompletedCheckpoint>(c);
}

}  // namespace xd
