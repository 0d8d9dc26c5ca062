# The CUDA library libjflash_cuda.so (included from CMakeLists.txt when a CUDA
# compiler is found).
#
# JFLASH_CUDA_ARCHS   semicolon list of GPU targets, SASS embedded for each:
#                     "80" (sm80; also runs on sm86/sm89) and "90a" (Hopper).
# JFLASH_CUDA_SUBSET  which kernel instantiations (csrc/cuda/instantiations/) to compile:
#                     all  every (direction, dtype, head dim, mask, score): 100
#                          files, 50 of the 99 KB tile column (flash_*_small_*),
#                          and, when 90a is a target, 30 of the Hopper forward
#                          and 30 of the Hopper backward, 6 decode kernels
#                          (flash_decode_*) and 60 float32 kernels
#                          (flash_*_tf32_*, flash_*_tf32x3_*): 276 in all, the
#                          segment-id kernels (flash_*_segments*) and the
#                          softcap kernels (flash_*_softcap, band and segments
#                          masks) of head dims 64, 128, 256 included;
#                     ci   bfloat16, head dim 128, the full and band masks, both directions:
#                          4 files, the 2 of the 99 KB backward, the 4 Hopper files (no
#                          segment-id or softcap kernels: "segments", "softcap"
#                          select those), the bfloat16 decode kernel of head dim 128,
#                          and the 3xTF32 float32 kernels of head dim 128, full mask;
#                     otherwise a comma (or semicolon) list of name fragments, and an
#                     instantiation is compiled when its file name contains one
#                     (e.g. "bf16_hdim64,fp16_hdim128_full").
# A head dim or dtype left out gives an ffi::Error that names JFLASH_CUDA_SUBSET.
#
# Build time (docs/cuda_kernels.md, "Build time"): nvcc's time goes to cicc's
# template work, much of which the instantiations of one head dim share, so the
# chosen files are compiled as one translation unit per head dim and kernel
# family (below): 24 for "all" instead of 276, the same SASS, started longest
# first.
# The sm80 forward and backward get no sm_90a SASS when 80 is a target
# (below, _gencode_sm80) unless JFLASH_CUDA_SM80_HOPPER_SASS is ON; the decode
# kernels and the float32 kernels do.

set(JFLASH_CUDA_ARCHS "80;90a" CACHE STRING "GPU architectures to embed SASS for")
set(JFLASH_CUDA_SUBSET "all" CACHE STRING "Kernel instantiations to compile: all, ci, or name fragments")
option(JFLASH_CUDA_SM80_HOPPER_SASS
       "Also embed sm_90a SASS for the sm80 forward and backward (running them on Hopper without the driver's PTX compile)"
       OFF)

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
  # Whole names' ends, so that the softcap kernels (..._band_softcap.cu) stay out.
  set(_fragments "bf16_hdim128_full.cu;bf16_hdim128_band.cu;decode_bf16_hdim128.cu;tf32x3_hdim128_full.cu")
else()
  string(REPLACE "," ";" _fragments "${JFLASH_CUDA_SUBSET}")
endif()
# Commas, not semicolons, in the defines: a semicolon would split the compile line.
string(REPLACE ";" "," _subset_define "${JFLASH_CUDA_SUBSET}")
string(REPLACE ";" "," _archs_define "${JFLASH_CUDA_ARCHS}")
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
# code: left out when 90a is not a target (the handlers then run the sm80
# kernels on Hopper too), else compiled in units of their own for 90a alone
# (below).
if(NOT "90a" IN_LIST JFLASH_CUDA_ARCHS)
  list(FILTER _instantiations EXCLUDE REGEX "/flash_(fwd|bwd)_sm90_[^/]*$")
endif()
list(LENGTH _instantiations _count)
if(_count EQUAL 0)
  message(FATAL_ERROR "jflash: JFLASH_CUDA_SUBSET='${JFLASH_CUDA_SUBSET}' selects no kernel instantiation")
endif()

# One translation unit per head dim and kernel family: a generated .cu that
# #includes the chosen instantiation files of the unit. cicc takes most of
# nvcc's time, and much of it is fixed per unit (CuTe and the kernel parts that
# the instantiations of a head dim share), so the kernels of a head dim share a
# unit (docs/cuda_kernels.md, "Build time", items 8-10; same templates, same
# flags: the SASS of every kernel stays the same):
#   flash_sm80_hdim<D>     the sm80 forward and backward: both dtypes, every
#                          mask and score, the 99 KB tile column
#   flash_sm90_hdim<D>     the Hopper forward and backward
#   flash_fwd_float32_hdim<D>            the float32 forward, TF32 and 3xTF32
#   flash_bwd_float32_hdim<D>[_softcap]  the float32 backward, its softcap
#                          kernels apart (two cicc passes each: one unit of both
#                          would be the build's longest by far)
#   flash_decode_hdim<D>   the decode kernels
# The head dims of _sm80_split_head_dims keep the sm80 forward and backward
# apart (flash_fwd_sm80_hdim<D>, flash_bwd_sm80_hdim<D>): at 256 one unit would
# outlast every other unit of the build.
set(_sm80_split_head_dims 256)
set(_group_dir "${CMAKE_CURRENT_BINARY_DIR}/jflash_kernels")
set(_groups "")
foreach(_file IN LISTS _instantiations)
  get_filename_component(_name "${_file}" NAME)
  if(_name MATCHES "^flash_decode_(fp16|bf16)_hdim([0-9]+)\\.cu$")
    set(_group "flash_decode_hdim${CMAKE_MATCH_2}")
    set(_kind decode)
  elseif(NOT _name MATCHES "^flash_(fwd|bwd)(_small|_sm90)?_(fp16|bf16|tf32|tf32x3)_hdim([0-9]+)_(full|band|segments)(_softcap)?\\.cu$")
    message(FATAL_ERROR "jflash: ${_name} is not named like csrc/cuda/generate_kernels.py's files")
  else()
    # Named copies: every MATCHES below resets CMAKE_MATCH_<n>.
    set(_dir "${CMAKE_MATCH_1}")
    set(_family "${CMAKE_MATCH_2}")
    set(_dtype "${CMAKE_MATCH_3}")
    set(_hdim "${CMAKE_MATCH_4}")
    set(_score "${CMAKE_MATCH_6}")
    if(_family STREQUAL "_sm90")
      set(_group "flash_sm90_hdim${_hdim}")
      set(_kind sm90)
    elseif(_dtype MATCHES "^tf32" AND _dir STREQUAL "fwd")
      set(_group "flash_fwd_float32_hdim${_hdim}")
      set(_kind float32_fwd)
    elseif(_dtype MATCHES "^tf32")
      set(_group "flash_bwd_float32_hdim${_hdim}${_score}")
      set(_kind float32_bwd)
    elseif(_hdim IN_LIST _sm80_split_head_dims)
      set(_group "flash_${_dir}_sm80_hdim${_hdim}")
      set(_kind sm80)
    else()
      set(_group "flash_sm80_hdim${_hdim}")
      set(_kind sm80)
    endif()
  endif()
  # A malformed group name would put several groups' kernels in one unit (a
  # serial build) or give a unit the wrong -gencode flags (the wrong SASS).
  if(NOT _group MATCHES "^flash_((sm80|sm90|decode)_hdim[0-9]+|(fwd|bwd)_sm80_hdim[0-9]+|fwd_float32_hdim[0-9]+|bwd_float32_hdim[0-9]+(_softcap)?)$")
    message(FATAL_ERROR "jflash: ${_name} went to the translation unit '${_group}'")
  endif()
  if(NOT _group IN_LIST _groups)
    list(APPEND _groups "${_group}")
    set(_includes_${_group} "")
    # The unit's kind, which picks its -gencode flags (below).
    set(_kind_${_group} ${_kind})
  endif()
  string(APPEND _includes_${_group} "#include \"cuda/instantiations/${_name}\"\n")
endforeach()
# Ninja starts the compiles in the order of the library's sources, so the units
# go longest first, so that none starts late and ends the build alone: the
# order of their compile times in a full build on 16 cores ("Build time", item
# 10). A unit the list lacks (a new head dim) follows the listed ones.
set(_unit_order
  flash_bwd_float32_hdim256 flash_sm90_hdim128 flash_sm90_hdim64 flash_bwd_float32_hdim128
  flash_bwd_float32_hdim64 flash_bwd_float32_hdim64_softcap flash_sm80_hdim128
  flash_bwd_sm80_hdim256 flash_sm90_hdim256 flash_bwd_float32_hdim128_softcap
  flash_bwd_float32_hdim256_softcap flash_sm80_hdim224 flash_sm80_hdim192 flash_sm80_hdim64
  flash_fwd_float32_hdim256 flash_fwd_float32_hdim64 flash_fwd_float32_hdim128
  flash_sm80_hdim96 flash_fwd_sm80_hdim256 flash_sm80_hdim160 flash_decode_hdim128
  flash_sm80_hdim32 flash_decode_hdim256 flash_decode_hdim64)
set(_ordered_groups "")
foreach(_group IN LISTS _unit_order)
  if(_group IN_LIST _groups)
    list(APPEND _ordered_groups "${_group}")
  endif()
endforeach()
foreach(_group IN LISTS _groups)
  if(NOT _group IN_LIST _ordered_groups)
    list(APPEND _ordered_groups "${_group}")
  endif()
endforeach()
set(_kernel_sources "")
file(GLOB _stale_groups "${_group_dir}/*.cu")
foreach(_group IN LISTS _ordered_groups)
  set(_source "${_group_dir}/${_group}.cu")
  list(REMOVE_ITEM _stale_groups "${_source}")
  # CONFIGURE writes the file only when its text changes, so that a
  # reconfigure does not recompile every group.
  file(CONFIGURE OUTPUT "${_source}" @ONLY
       CONTENT "// Generated by csrc/cuda/cuda.cmake: ${_group} in this build.\n${_includes_${_group}}")
  list(APPEND _kernel_sources "${_source}")
endforeach()
if(_stale_groups)
  file(REMOVE ${_stale_groups})
endif()
list(LENGTH _groups _count_groups)
message(STATUS "jflash: compiling ${_count} CUDA kernel instantiations in ${_count_groups} files "
               "(JFLASH_CUDA_SUBSET=${JFLASH_CUDA_SUBSET}) for archs ${JFLASH_CUDA_ARCHS}")

add_library(jflash_cuda SHARED
  csrc/ffi/cuda_handlers.cu
  csrc/ffi/version.cc
  csrc/cuda/registry.cu)
# Every kernel unit in one object library, in _ordered_groups' order, each with
# the -gencode flags of its kind (a source property, below).
add_library(jflash_cuda_kernels OBJECT ${_kernel_sources})
target_sources(jflash_cuda PRIVATE $<TARGET_OBJECTS:jflash_cuda_kernels>)
set(_cuda_targets jflash_cuda jflash_cuda_kernels)
foreach(_target IN LISTS _cuda_targets)
  target_include_directories(${_target} PRIVATE csrc csrc/include)
  # SYSTEM: their own warnings (XLA's missing returns, CuTe's) are not ours to fix.
  target_include_directories(${_target} SYSTEM PRIVATE "${JFLASH_XLA_INCLUDE_DIR}"
                                                       "${JFLASH_CUTLASS_INCLUDE_DIR}")
  target_compile_definitions(${_target} PRIVATE
    JFLASH_BUILD_JAXLIB_VERSION="${JFLASH_BUILD_JAXLIB_VERSION}"
    JFLASH_CUDA_SUBSET="${_subset_define}"
    JFLASH_CUDA_ARCHS="${_archs_define}")
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
# nvcc takes it from the cicc pass that feeds the sm_80 SASS: no compile time.
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
# The sm80 forward and backward (not the decode kernels, which every GPU runs):
# SASS for the archs of the list but 90a, and the compute_80 PTX. Hopper runs
# them only where the Hopper kernels refuse a call (TMA alignment, empty
# sequences) or are switched off (JFLASH_CUDA_FORWARD/BACKWARD=sm80,
# JFLASH_CUDA_SMEM_LIMIT), since every head dim has a Hopper kernel to run on
# (head_dims.h, sm90_kernel_head_dim): there the driver compiles their PTX at
# first use (cached on disk), and the build skips a cicc pass per unit, about
# half of each unit's time (docs/cuda_kernels.md, "Build time"). Without 80
# in the list (no compute_80 PTX to fall back on), or with
# JFLASH_CUDA_SM80_HOPPER_SASS ON (for comparisons and tests of the sm80
# kernels on Hopper, where the first use of each unit would wait seconds for
# the driver's compile), they keep its SASS.
set(_gencode_sm80 "${_gencode}")
if("80" IN_LIST JFLASH_CUDA_ARCHS AND NOT JFLASH_CUDA_SM80_HOPPER_SASS)
  list(REMOVE_ITEM _gencode_sm80 "-gencode=arch=compute_90a,code=sm_90a")
endif()
# The float32 kernels are the sm80 kernels on TF32 MMAs and have no Hopper
# counterpart (wgmma takes TF32 operands K-major only, and P V's V is not):
# Hopper runs them, so they get SASS for every arch of the list. The forward
# has no code of its own for sm_90, so its sm_90 SASS comes from the compute_80
# PTX: one cicc pass per unit instead of two (cicc is ~95% of a float32 unit's
# time; the sm_90 SASS is the same instruction for instruction). The backward
# keeps a compute_90a pass: its dQ accumulation adds float pairs with one
# atomic there (sm_90 PTX), and the compute_80 code's two scalar atomics
# measured 13% slower TF32 forward+backward at head dim 128 (H100, 741dacaa).
set(_gencode_float32_fwd "${_gencode}")
if("80" IN_LIST JFLASH_CUDA_ARCHS AND "90a" IN_LIST JFLASH_CUDA_ARCHS)
  list(REMOVE_ITEM _gencode_float32_fwd "-gencode=arch=compute_80,code=sm_80"
                                        "-gencode=arch=compute_90a,code=sm_90a")
  list(APPEND _gencode_float32_fwd "-gencode=arch=compute_80,code=[sm_80,sm_90]")
endif()
set(_gencode_float32_bwd "${_gencode}")
set(_gencode_sm90 "-gencode=arch=compute_90a,code=sm_90a")
# The decode kernels, which every GPU runs, and whose Hopper code waits for its
# prerequisite grids (griddepcontrol, sm_90 PTX): the full list.
set(_gencode_decode "${_gencode}")
target_compile_options(jflash_cuda_kernels PRIVATE -O3 --expt-relaxed-constexpr -lineinfo)
foreach(_group IN LISTS _ordered_groups)
  set_source_files_properties("${_group_dir}/${_group}.cu" PROPERTIES
    COMPILE_OPTIONS "${_gencode_${_kind_${_group}}}")
endforeach()
target_link_libraries(jflash_cuda PRIVATE CUDA::cudart_static)
install(TARGETS jflash_cuda LIBRARY DESTINATION ${JFLASH_INSTALL_DIR})
