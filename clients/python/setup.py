"""The moongate_kv wheel, with the library it binds: setuptools-rust builds
libmoongate_kv.so from the C ABI crate (clients/rust, `Binding.NoBinding`: a plain
cdylib for ctypes, the same file C engines link) and puts it in the package, beside the
module that loads it; the C header goes in `moongate_kv/include/`. The version is the
workspace's (Cargo.toml), so the wheel, the library and moongate carry one number.

    bash scripts/wheel.sh          # builds it (manylinux-tagged) into target/wheels/

Metadata is in pyproject.toml; only what needs code is here.
"""
import os
import re
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools_rust import Binding, RustExtension, Strip

HERE = os.path.dirname(os.path.abspath(__file__))
# The repository (scripts/wheel.sh builds from a copy of this directory and says where).
ROOT = os.environ.get("MOONGATE_WORKSPACE") or os.path.normpath(os.path.join(HERE, "..", ".."))


def workspace_version():
    with open(os.path.join(ROOT, "Cargo.toml")) as f:
        text = f.read()
    section = text.split("[workspace.package]", 1)[1].split("\n[", 1)[0]
    return re.search(r'^version\s*=\s*"([^"]+)"', section, re.M).group(1)


class BuildPyWithHeader(build_py):
    """The package, and the C header beside it (include/moongate_kv.h)."""

    def run(self):
        super().run()
        dst = os.path.join(self.build_lib, "moongate_kv", "include")
        os.makedirs(dst, exist_ok=True)
        shutil.copy(os.path.join(ROOT, "clients", "rust", "include", "moongate_kv.h"), dst)


setup(
    version=workspace_version(),
    rust_extensions=[
        RustExtension(
            "moongate_kv.libmoongate_kv",
            path=os.path.join(ROOT, "clients", "rust", "Cargo.toml"),
            binding=Binding.NoBinding,
            args=["--locked"],
            # The release profile keeps debug info for profiling moongate (21 MB here);
            # the wheel's library keeps its symbols, not the rest.
            strip=Strip.Debug,
        )
    ],
    cmdclass={"build_py": BuildPyWithHeader},
    # The library is loaded from the installed package's directory.
    zip_safe=False,
)
