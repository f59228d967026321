// The MPI backend in a build without MPI (CHORUS_WITH_MPI off: CMake found no MPI): it says so.
#include "chorus/comm/error.h"
#include "chorus/comm/mpi.h"

namespace chorus {

bool mpi_available() { return false; }

std::shared_ptr<ProcessGroup> connect_mpi_process_group(ProcessGroupOptions) {
  throw UsageError(
      "chorus: the MPI backend is not in this build of chorus (CHORUS_WITH_MPI was off: CMake found no MPI); "
      "install Open MPI's development files (Debian: apt-get install libopenmpi-dev openmpi-bin, or "
      "scripts/install-deps) and configure and build again; or use the backends every build has: \"chorus\", "
      "\"tcp\", \"shm\", \"hybrid\"");
}

}  // namespace chorus
