// File-system helpers the libraries share.
#pragma once

#include <string>
#include <system_error>

namespace chorus {

// Deletes `path` and, when it is a directory, everything under it, without following symbolic
// links (a link is removed, not what it points to). A path that does not exist is not an error.
// On failure `ec` holds the first error; entries that could be removed are gone.
//
// Why not std::filesystem::remove_all: PyTorch's wheels (libtorch 2.x) export their own copies of
// libstdc++'s std::filesystem functions, and a program linked so that libtorch.so comes first binds
// to their remove_all, which calls a null pointer (docs/gpu.md). This one uses POSIX nftw only.
void remove_tree(const std::string& path, std::error_code& ec);

}  // namespace chorus
