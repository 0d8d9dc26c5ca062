# The CUDA library libjflash_cuda.so (included from CMakeLists.txt when a CUDA
# compiler is found).
#
# JFLASH_CUDA_ARCHS   semicolon list of GPU targets, SASS embedded for each:
#                     "80" (sm80; also runs on sm86/sm89) and "90a" (Hopper).
# JFLASH_CUDA_SUBSET  which kernel instantiations (csrc/cuda/instantiations/) to compile:
#                     all  every (direction, dtype, head dim, mask): 64 files, 32
#                          of the 99 KB tile column (flash_*_small_*), and 12 of
#                          the Hopper forward when 90a is a target;
#                     ci   bfloat16, head dim 128, the full and band masks, both directions:
#                          4 files, the 2 of the 99 KB backward, the 4 Hopper files (no
#                          segment-id kernels: "segments" selects those);
#                     otherwise a comma (or semicolon) list of name fragments, and an
#                     instantiation is compiled when its file name contains one
#                     (e.g. "bf16_hdim64,fp16_hdim128_full").
# A head dim or dtype left out gives an ffi::Error that names JFLASH_CUDA_SUBSET.

set(JFLASH_CUDA_ARCHS "80;90a" CACHE STRING "GPU architectures to embed SASS for")
set(JFLASH_CUDA_SUBSET "all" CACHE STRING "Kernel instantiations to compile: all, ci, or name fragments")

# CuTe/CUTLASS headers from the nvidia-cutlass wheel (the `cuda` extra). Without
# them, AUTO builds the CPU kernels only and says so; ON fails.
execute_process(
  COMMAND "${Python_EXECUTABLE}" -c
          "import cutlass_library, os; print(os.path.join(os.path.dirname(cutlass_library.__file__), 'source', 'include'))"
  OUTPUT_VARIABLE JFLASH_CUTLASS_INCLUDE_DIR OUTPUT_STRIP_TRAILING_WHITESPACE
  RESULT_VARIABLE _cutlass_rc ERROR_QUIET)
if(NOT _cutlass_rc EQUAL 0 OR NOT EXISTS "${JFLASH_CUTLASS_INCLUDE_DIR}/cute/tensor.hpp")
  set(_no_cutlass "jflash: the CUDA kernels need the CuTe headers of nvidia-cutlass==4.2.0.0; "
                  "pip install 'nvidia-cutlass==4.2.0.0' (or build with JFLASH_CUDA=OFF)")
  if(JFLASH_CUDA STREQUAL "ON")
    message(FATAL_ERROR ${_no_cutlass})
  endif()
  message(WARNING ${_no_cutlass} " -- building the CPU kernels only")
  return()
endif()
message(STATUS "jflash: CuTe headers: ${JFLASH_CUTLASS_INCLUDE_DIR}")

enable_language(CUDA)
find_package(CUDAToolkit REQUIRED)

file(GLOB _all_instantiations CONFIGURE_DEPENDS "${CMAKE_CURRENT_LIST_DIR}/instantiations/*.cu")
if(JFLASH_CUDA_SUBSET STREQUAL "all")
  set(_fragments "flash_")
elseif(JFLASH_CUDA_SUBSET STREQUAL "ci")
  set(_fragments "bf16_hdim128_full;bf16_hdim128_band")
else()
  string(REPLACE "," ";" _fragments "${JFLASH_CUDA_SUBSET}")
endif()
# Commas, not semicolons, in the define: a semicolon would split the compile line.
string(REPLACE ";" "," _subset_define "${JFLASH_CUDA_SUBSET}")
set(_instantiations "")
foreach(_file IN LISTS _all_instantiations)
  get_filename_component(_name "${_file}" NAME)
  foreach(_fragment IN LISTS _fragments)
    string(FIND "${_name}" "${_fragment}" _pos)
    if(NOT _pos EQUAL -1)
      list(APPEND _instantiations "${_file}")
      break()
    endif()
  endforeach()
endforeach()
# The Hopper kernels (flash_fwd_sm90_*, flash_bwd_sm90_*) exist only as sm_90a
# code: compiled in their own object library for 90a alone, and left out when
# 90a is not a target (the handlers then run the sm80 kernels on Hopper too).
set(_sm90_instantiations "${_instantiations}")
list(FILTER _sm90_instantiations INCLUDE REGEX "flash_(fwd|bwd)_sm90_")
list(FILTER _instantiations EXCLUDE REGEX "flash_(fwd|bwd)_sm90_")
if(NOT "90a" IN_LIST JFLASH_CUDA_ARCHS)
  set(_sm90_instantiations "")
endif()
list(LENGTH _instantiations _count_sm80)
list(LENGTH _sm90_instantiations _count_sm90)
math(EXPR _count "${_count_sm80} + ${_count_sm90}")
if(_count EQUAL 0)
  message(FATAL_ERROR "jflash: JFLASH_CUDA_SUBSET='${JFLASH_CUDA_SUBSET}' selects no kernel instantiation")
endif()
message(STATUS "jflash: compiling ${_count} CUDA kernel instantiations (JFLASH_CUDA_SUBSET=${JFLASH_CUDA_SUBSET}) for archs ${JFLASH_CUDA_ARCHS}")

add_library(jflash_cuda SHARED
  csrc/ffi/cuda_handlers.cu
  csrc/ffi/version.cc
  csrc/cuda/registry.cu
  ${_instantiations})
set(_cuda_targets jflash_cuda)
if(_sm90_instantiations)
  add_library(jflash_cuda_sm90 OBJECT ${_sm90_instantiations})
  target_sources(jflash_cuda PRIVATE $<TARGET_OBJECTS:jflash_cuda_sm90>)
  list(APPEND _cuda_targets jflash_cuda_sm90)
endif()
foreach(_target IN LISTS _cuda_targets)
  target_include_directories(${_target} PRIVATE csrc csrc/include)
  # SYSTEM: their own warnings (XLA's missing returns, CuTe's) are not ours to fix.
  target_include_directories(${_target} SYSTEM PRIVATE "${JFLASH_XLA_INCLUDE_DIR}"
                                                       "${JFLASH_CUTLASS_INCLUDE_DIR}")
  target_compile_definitions(${_target} PRIVATE
    JFLASH_BUILD_JAXLIB_VERSION="${JFLASH_BUILD_JAXLIB_VERSION}"
    JFLASH_CUDA_SUBSET="${_subset_define}")
  set_target_properties(${_target} PROPERTIES
    CUDA_ARCHITECTURES OFF
    CUDA_STANDARD 17
    CUDA_STANDARD_REQUIRED ON
    POSITION_INDEPENDENT_CODE ON
    CUDA_VISIBILITY_PRESET hidden)
endforeach()

# Explicit -gencode flags (not CUDA_ARCHITECTURES) so that 90a is spelled the
# way nvcc 13.0 accepts for sm_90a-only instructions (the arch-specific
# "a" targets need -gencode arch=compute_90a,code=sm_90a).
set(_gencode "")
foreach(_arch IN LISTS JFLASH_CUDA_ARCHS)
  list(APPEND _gencode "-gencode=arch=compute_${_arch},code=sm_${_arch}")
endforeach()
# PTX of the sm80 kernels too: GPUs newer than every embedded SASS target (e.g.
# Blackwell) compile it at load time instead of failing with "no kernel image".
if("80" IN_LIST JFLASH_CUDA_ARCHS)
  list(APPEND _gencode "-gencode=arch=compute_80,code=compute_80")
endif()
set_target_properties(jflash_cuda PROPERTIES
  PREFIX "lib"
  # Static cudart: the library loads (and its handlers register) on machines
  # with no GPU driver, e.g. CI; the runtime finds the driver lazily at first use.
  CUDA_RUNTIME_LIBRARY Static)
target_compile_options(jflash_cuda PRIVATE
  $<$<COMPILE_LANGUAGE:CUDA>:${_gencode} -O3 --expt-relaxed-constexpr -lineinfo>
  $<$<COMPILE_LANGUAGE:CXX>:-O3 -Wall -Wextra>)
if(_sm90_instantiations)
  target_compile_options(jflash_cuda_sm90 PRIVATE
    -gencode=arch=compute_90a,code=sm_90a -O3 --expt-relaxed-constexpr -lineinfo)
endif()
target_link_libraries(jflash_cuda PRIVATE CUDA::cudart_static)
install(TARGETS jflash_cuda LIBRARY DESTINATION ${JFLASH_INSTALL_DIR})
