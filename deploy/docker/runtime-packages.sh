#!/bin/sh
# Prints the Debian/Ubuntu packages that own the shared libraries BINARY loads, one per line,
# so that the runtime image installs exactly those (on the same distribution release as the
# build stage). Fails when a resolved library belongs to no package. Libraries ldd cannot find
# (the CUDA driver, which the NVIDIA container runtime mounts) are skipped.
# usage: runtime-packages.sh BINARY
set -eu
binary=$1
ldd "$binary" | awk '$3 ~ /^\// {print $3}' | while read -r lib; do
  # */<multiarch dir>/<name>: the architecture's copy, not a lib32 one of the same name.
  owner=$(dpkg -S "*/$(basename "$(dirname "$lib")")/$(basename "$lib")" 2>/dev/null | cut -d: -f1) || true
  if [ -z "$owner" ]; then
    echo "runtime-packages.sh: no package owns $lib" >&2
    exit 1
  fi
  echo "$owner" | tr ',' '\n' | tr -d ' '
done | sort -u
