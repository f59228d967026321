// Internal: a bounds check of a pickle before libtorch's unpickler reads it.
//
// libtorch 1.13's unpickler sizes its buffers by what the pickle claims before reading: a string
// opcode claiming 3.9 GB in a 6 KB model.pt made load_checkpoint allocate 3.9 GB before it failed
// (found by fuzz/checkpoint.cc), and a memo index near 2^32 reserves a memo table of that size.
// check_pickle_bounds walks the opcodes without building anything and refuses such claims first.
// Pure: no libtorch, no I/O.
#pragma once

#include <cstddef>
#include <string>

namespace chorus::train::detail {

// Throws CheckpointError naming `what` (e.g. "model.pt") when an opcode of `pickle` claims more
// bytes than follow it, or a memo index beyond the entries stored so far (pickle writers number
// them from 0 in order), or the pickle ends without STOP. Opcodes it does not know end the walk:
// the unpickler refuses them itself.
void check_pickle_bounds(const char* pickle, size_t size, const std::string& what);

}  // namespace chorus::train::detail
