"""The one native piece: kv_transfer._copysum (copy + checksum in one pass). Optional: without a C
compiler the install goes on and the transfer service uses its numpy/torch path (kv_transfer.native)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("kv_transfer._copysum", ["kv_transfer/_copysum.c"], extra_compile_args=["-O3"], optional=True),
    ],
)
