"""The native pieces, both optional: without a C compiler the install goes on and Tandem runs on its
numpy/torch paths, with the same results.

- ``kv_transfer._copysum``: the KV transfer's copy + checksum in one pass (kv_transfer.native).
- ``kernels._cpu_ops``: the CPU kernels of the hot path, paged attention first (kernels/cpu_backend.py).
  Built with OpenMP, whose runtime at run time is the one torch loads (libgomp.so.1); a compiler
  without OpenMP builds it single-threaded.
"""

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

OPENMP_FLAGS = ["-fopenmp"]


class BuildExtOpenMPOptional(build_ext):
    """Builds each extension with OpenMP, and again without it where the compiler has none."""

    def build_extension(self, ext):
        if not any(flag in ext.extra_compile_args for flag in OPENMP_FLAGS):
            return super().build_extension(ext)
        try:
            return super().build_extension(ext)
        except Exception as exc:  # noqa: BLE001 - any compiler failure: retry plain, then let optional decide
            print(f"building {ext.name} with OpenMP failed ({exc}); building it single-threaded")
            ext.extra_compile_args = [f for f in ext.extra_compile_args if f not in OPENMP_FLAGS]
            ext.extra_link_args = [f for f in ext.extra_link_args if f not in OPENMP_FLAGS]
            return super().build_extension(ext)


setup(
    ext_modules=[
        Extension("kv_transfer._copysum", ["kv_transfer/_copysum.c"], extra_compile_args=["-O3"], optional=True),
        Extension(
            "kernels._cpu_ops", ["kernels/native/cpu_ops.c"], depends=[f"kernels/native/{name}" for name in ("vec_isa.h", "bf16_pairs_isa.h", "paged_attention_isa.h", "paged_attention_pairs_isa.h", "elementwise_isa.h", "int8_isa.h", "int8_gemm.h", "moe_gemm.h", "decoder_stack.h", "isa_undef.h")],
            extra_compile_args=["-O3", "-std=gnu11", "-ffp-contract=fast", "-Wno-psabi", *OPENMP_FLAGS],
            extra_link_args=OPENMP_FLAGS, optional=True,
        ),
    ],
    cmdclass={"build_ext": BuildExtOpenMPOptional},
)
