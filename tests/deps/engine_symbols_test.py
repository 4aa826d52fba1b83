#!/usr/bin/env python3
"""The router, the control-plane libraries and the engine API use no symbol of the engine's runtime
or the kernels.

CMake's link check (tandem_forbid_links, top-level CMakeLists.txt) stops a forbidden link; this
test catches the other way back in: the engine API's headers sit beside the engine's, so router
code could include an engine header and call it, and a binary that links both (the `tandem`
binary) would still link. Here every symbol those archives leave undefined is looked up among the
symbols the engine and kernel archives define.

usage: engine_symbols_test.py --users A.a [A.a ...] --forbidden B.a [B.a ...]
"""
import argparse
import subprocess
import sys
import unittest

ARGS = None


def symbols(archive, *flags, strong_only=False):
    out = subprocess.run(["nm", "--format=posix", "--no-sort", *flags, archive],
                         check=True, capture_output=True, text=True).stdout
    # "name type [value size]"; archive member headers ("lib.a[x.o]:") have no type field.
    # Weak definitions (inline functions, template instantiations: W, V, u) are emitted by
    # every object that uses them, so only strong ones say where a symbol comes from.
    names = set()
    for line in out.splitlines():
        fields = line.split()
        if len(fields) < 2 or line.endswith(":"):
            continue
        if strong_only and fields[1] in ("W", "w", "V", "v", "u"):
            continue
        names.add(fields[0])
    return names


def engine_symbols():
    names = set()
    for archive in ARGS.forbidden:
        names |= symbols(archive, "--defined-only", "--extern-only", strong_only=True)
    return names


def demangle(names):
    out = subprocess.run(["c++filt"], input="\n".join(names), check=True, capture_output=True,
                         text=True).stdout
    return out.splitlines()


class EngineSymbolsTest(unittest.TestCase):
    def test_no_user_needs_an_engine_or_kernel_symbol(self):
        forbidden = engine_symbols()
        self.assertTrue(forbidden, "the engine archives define no symbols: wrong paths?")
        for archive in ARGS.users:
            used = symbols(archive, "--undefined-only") & forbidden
            if used:
                self.fail(f"{archive} uses the engine's runtime or the kernels:\n  "
                          + "\n  ".join(sorted(demangle(sorted(used)))[:20]))

    def test_detects_a_user_of_the_engine(self):
        # The check itself: the tools library does use the engine, so it must be reported.
        self.assertTrue(symbols(ARGS.tools, "--undefined-only") & engine_symbols())


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--users", nargs="+", required=True)
    parser.add_argument("--forbidden", nargs="+", required=True)
    parser.add_argument("--tools", required=True)
    ARGS, rest = parser.parse_known_args()
    unittest.main(argv=[sys.argv[0]] + rest)
