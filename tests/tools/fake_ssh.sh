#!/bin/sh
# Stands in for ssh in tests: takes ssh's options and the host, then runs the
# remote command here through a shell, as sshd would. Each call appends
# "HOST PID COMMAND" to $FAKE_SSH_LOG. Hosts ending in .invalid fail as an unreachable
# host does (exit 255).
while [ $# -gt 0 ]; do
  case "$1" in
    -o|-p|-l|-i|-F|-J) shift 2 ;;
    -*) shift ;;
    *) break ;;
  esac
done
host=$1
shift
if [ -n "$FAKE_SSH_LOG" ]; then echo "$host $$ $*" >> "$FAKE_SSH_LOG"; fi
case "$host" in
  *.invalid) echo "ssh: Could not resolve hostname $host: Name or service not known" >&2; exit 255 ;;
esac
exec sh -c "$*"
