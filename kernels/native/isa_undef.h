/* Ends one instruction set's copy of the bodies (cpu_ops.c includes this after each). */
#undef ISA
#undef VEC_BYTES
#undef W
#undef vf
#undef vfu
#undef vi
#undef vu
#undef vh
#undef ROUNDED
#undef X86_REGISTER
#undef vb
