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

// Throws CheckpointError naming `what` when an entry of the zip archive `zip` claims an
// uncompressed size that its bytes cannot hold (more than the archive for a stored entry, more
// than deflate's 1032:1 for a compressed one): libtorch's PyTorchStreamReader::getRecord
// allocates that size before it extracts (4 GB for a damaged model.pt of a few KB, found by
// fuzz_checkpoint). An archive whose directory it cannot read is left to the zip reader.
void check_zip_sizes(const char* zip, size_t size, const std::string& what);

}  // namespace chorus::train::detail
