#!/usr/bin/env python3
"""Checks the include directions between xdmoe's modules (docs/architecture.md).

Rules:
  1. A file of module M includes project headers only of the modules M may
     depend on (ALLOWED below).
  2. A module's internals (X/detail/...) are included only from module X
     itself, and from tests/ (unit tests of the internals).
  3. Public headers (X/*.h, not under detail/) include neither ZeroMQ nor any
     detail/ header, so the public surface stays small and library-neutral.

Usage: check_includes.py [ROOT]      check the tree at ROOT (default: this repo)
       check_includes.py --self-test  prove that each rule catches a violation
Exit status 0 when clean, 1 with one line per violation otherwise.
"""
import os
import re
import sys
import tempfile

# Who may include whom. Every module may include itself.
ALLOWED = {
    "common": set(),
    "model": {"common"},
    "compression": {"common"},
    "transport": {"common", "compression"},
    "cluster": {"common", "model", "compression"},
    "coordinator": {"common", "model", "compression", "transport", "cluster"},
    "actors": {"common", "model", "compression", "transport", "cluster"},
    "simulation": {"common", "model", "compression", "transport", "cluster", "coordinator"},
    "cli": {"common", "model", "compression", "transport", "cluster", "coordinator", "actors", "simulation"},
    "tests": None,  # anything
    "bench": None,
    "fuzz": None,
}
SOURCE_SUFFIXES = (".h", ".cc")
INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]')
ZMQ_HEADERS = {"zmq.h", "zmq.hpp", "zmq_addon.hpp"}


def violations(root):
    found = []
    for module in sorted(ALLOWED):
        base = os.path.join(root, module)
        if not os.path.isdir(base):
            continue
        for dirpath, _, files in os.walk(base):
            for name in sorted(files):
                if not name.endswith(SOURCE_SUFFIXES):
                    continue
                path = os.path.join(dirpath, name)
                rel = os.path.relpath(path, root)
                public_header = (name.endswith(".h") and "detail" not in rel.split(os.sep)
                                 and module not in ("tests", "bench", "cli"))
                with open(path, encoding="utf-8", errors="replace") as f:
                    for lineno, line in enumerate(f, 1):
                        m = INCLUDE.match(line)
                        if not m:
                            continue
                        quote, target = m.groups()
                        where = f"{rel}:{lineno}: {line.strip()}"
                        if quote == "<":
                            if public_header and target in ZMQ_HEADERS:
                                found.append(f"{where}: a public header must not include ZeroMQ")
                            continue
                        parts = target.split("/")
                        if len(parts) < 2 or parts[0] not in ALLOWED:
                            continue  # a sibling or third-party header
                        dep = parts[0]
                        allowed = ALLOWED[module]
                        if dep != module and allowed is not None and dep not in allowed:
                            found.append(f"{where}: {module}/ may not include {dep}/ "
                                         f"(allowed: {', '.join(sorted(allowed)) or 'nothing'})")
                        if "detail" in parts[1:-1]:
                            if dep != module and module != "tests":
                                found.append(f"{where}: {dep}/detail/ is internal to {dep}/")
                            elif public_header:
                                found.append(f"{where}: a public header must not include a detail/ header")
    return found


def self_test():
    """Each rule, broken once in a scratch tree, must be reported."""
    cases = {
        "actors/bad.h": '#include "coordinator/planner.h"\n',
        "model/bad.cc": '#include "transport/transport.h"\n',
        "cli/bad.cc": '#include "model/detail/secret.h"\n',
        "transport/bad.h": "#include <zmq.hpp>\n",
        "transport/bad2.h": '#include "transport/detail/impl.h"\n',
    }
    clean = {
        "transport/detail/impl.h": "#include <zmq.hpp>\n",
        "transport/ok.cc": '#include "transport/detail/impl.h"\n#include <zmq.hpp>\n',
        "tests/ok_test.cc": '#include "transport/detail/impl.h"\n#include "coordinator/planner.h"\n',
        "actors/ok.h": '#include "cluster/protocol.h"\n#include <vector>\n',
    }
    failures = 0
    for bad, text in cases.items():
        with tempfile.TemporaryDirectory() as root:
            for rel, body in list(clean.items()) + [(bad, text)]:
                os.makedirs(os.path.join(root, os.path.dirname(rel)), exist_ok=True)
                with open(os.path.join(root, rel), "w") as f:
                    f.write(body)
            got = violations(root)
            if len(got) != 1 or not got[0].startswith(bad):
                print(f"self-test: {bad} should give exactly one violation, got {got}")
                failures += 1
            else:
                print(f"self-test: caught {got[0]}")
    return 1 if failures else 0


def main(argv):
    if argv[1:] == ["--self-test"]:
        return self_test()
    root = argv[1] if len(argv) > 1 else os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    found = violations(root)
    for v in found:
        print(v)
    if found:
        print(f"{len(found)} forbidden include(s); the allowed directions are in docs/architecture.md")
        return 1
    print("include directions: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
