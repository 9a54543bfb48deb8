#!/usr/bin/env bash
# Installs the Debian packages xdmoe builds, tests and benchmarks with.
# Idempotent: packages already present are skipped, so a second run is quick.
set -euo pipefail

packages=(
  build-essential cmake pkg-config git
  libzmq3-dev cppzmq-dev libmsgpack-cxx-dev libzstd-dev zstd
  libopenblas-dev libspdlog-dev libfmt-dev
  libcli11-dev libyaml-cpp-dev nlohmann-json3-dev libcpp-httplib-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  gnuplot-nox
  openmpi-bin libopenmpi-dev python3-mpi4py
  python3 python3-numpy python3-torch
  iproute2
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
