// The worker process (`xdmoe worker`): one accelerator slot of a job.
//   control actor  registers with the coordinator, exchanges heartbeats
//                  (lost after 3 missed intervals, either way), applies
//                  assignments, stop and throttle orders, forwards metrics;
//   compute actor  runs the DistributedTrainer step by step;
//   comm actors    the Transport's I/O thread and the expert communicator.
// run_worker() returns the process exit code: 0 when the job finished.
#pragma once

#include <string>

namespace xd {

struct WorkerOptions {
  std::string coordinator = "tcp://127.0.0.1:7371";
  int rank = -1;                     // -1: from the launcher's environment, else any
  std::string bind_host = "127.0.0.1";
  std::string host_label;            // shown by `xdmoe status`; default: hostname
  double heartbeat_interval_s = 1.0;
  int liveness = 3;
};

// The rank a launcher gave this process: OMPI_COMM_WORLD_RANK, PMI_RANK,
// SLURM_PROCID, or -1.
int rank_from_environment();

int run_worker(const WorkerOptions& options);

}  // namespace xd
