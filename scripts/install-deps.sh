#!/usr/bin/env bash
# Installs the Debian packages xdmoe builds, tests and benchmarks with.
# Idempotent: packages already present are skipped, so a second run is quick.
set -euo pipefail

packages=(
  # build
  build-essential cmake pkg-config
  # libraries the code links or includes (CMakeLists.txt)
  libzmq3-dev cppzmq-dev libmsgpack-cxx-dev libzstd-dev libopenblas-dev libspdlog-dev libfmt-dev
  libcli11-dev libyaml-cpp-dev nlohmann-json3-dev libcpp-httplib-dev
  # simulation/: SimGrid's flow-level network model
  libsimgrid-dev
  # tests: googletest; python3 runs the include check; torch the reference model
  libgtest-dev python3 python3-torch
  # fuzz/: clang, and its libFuzzer and sanitizer runtimes (libclang_rt.*)
  clang libclang-rt-14-dev
  # bench/: OpenMPI and mpi4py/numpy baselines, gnuplot plots
  openmpi-bin python3-mpi4py python3-numpy gnuplot-nox
  # launchers the tests run for real: Slurm (scripts/slurm-local.sh) and the
  # network namespaces of scripts/netns-cluster.sh (ip, tc)
  slurm-wlm munge iproute2
)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#packages[@]} packages present"
  exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
$SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
