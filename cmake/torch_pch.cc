// Compiled only so that chorus_torch_pch's precompiled <torch/torch.h> and <gtest/gtest.h> are built;
// the libtorch test programs reuse them (cmake/chorus.cmake, chorus_apply_torch_pch).
