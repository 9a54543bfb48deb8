// The worker process (`xdmoe worker`): one accelerator slot of a job.
//   control actor  registers with the coordinator, exchanges heartbeats
//                  (lost after 3 missed intervals, either way), applies
//                  assignments, stop and throttle orders, forwards metrics;
//   compute actor  runs the DistributedTrainer step by step;
//   comm actors    the Transport's I/O thread and the expert communicator.
// run_worker() returns the process exit code: 0 when the job finished.
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace xd {

struct WorkerOptions {
  std::string coordinator = "tcp://127.0.0.1:7371";
  int rank = -1;                     // -1: from the launcher's environment, else any
  std::string bind_host = "127.0.0.1";
  std::string advertise_host;        // the host peers connect to; default: the bound one
  std::string host_label;            // shown by `xdmoe status`; default: hostname
  // Link classes whose bandwidth the kernel shapes (scripts/netns-cluster.sh's
  // tbf): the process adds only their latency.
  std::vector<std::string> kernel_shaped;
  // The rank came from a launcher's environment: its process count
  // (world_from_environment) must then be the job's.
  bool check_launcher_world = false;
  double heartbeat_interval_s = 1.0;
  int liveness = 3;
  // CURVE (transport/security.h): this worker's secret key file and the
  // coordinator's public key (a .pub file or Z85). Both or neither; neither:
  // plaintext.
  std::string key_file, coordinator_key;
};

// The rank a launcher gave this process: OMPI_COMM_WORLD_RANK, PMI_RANK,
// SLURM_PROCID, or -1.
int rank_from_environment();

// The number of processes the launcher started, with the variable that said
// so: OMPI_COMM_WORLD_SIZE, PMI_SIZE or SLURM_NTASKS; {-1, ""} when none did.
std::pair<int, std::string> world_from_environment();

int run_worker(const WorkerOptions& options);

}  // namespace xd
