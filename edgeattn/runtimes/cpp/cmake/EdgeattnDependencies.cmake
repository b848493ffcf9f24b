# The two dependencies of the edgeattn C++ runtime, as targets:
#
#   onnxruntime::onnxruntime   ONNX Runtime, from ONNXRUNTIME_ROOT (an official release with include/ and lib/), or
#                              by default the Python wheel's libonnxruntime.so.1.* with the headers that
#                              scripts/fetch_onnxruntime_headers.sh puts in .third_party/
#   edgeattn_nlohmann_json     nlohmann/json.hpp (header only), from the system or .third_party/
include_guard(GLOBAL)

set(ONNXRUNTIME_ROOT "$ENV{ONNXRUNTIME_ROOT}" CACHE PATH
    "An ONNX Runtime release directory (include/ and lib/); empty: the Python wheel's library")
if(DEFINED ENV{EDGEATTN_THIRD_PARTY})
  set(_third_party_default "$ENV{EDGEATTN_THIRD_PARTY}")
else()
  set(_third_party_default "${EDGEATTN_REPO_ROOT}/.third_party")
endif()
set(EDGEATTN_THIRD_PARTY "${_third_party_default}" CACHE PATH "Where scripts/fetch_onnxruntime_headers.sh unpacks headers")
set(_fetched_include "${EDGEATTN_THIRD_PARTY}/debian/usr/include")
set(_fetch_hint "run `bash scripts/fetch_onnxruntime_headers.sh` (or set ONNXRUNTIME_ROOT to an ONNX Runtime release)")

# ---- ONNX Runtime -------------------------------------------------------------------------------------------------
if(ONNXRUNTIME_ROOT)
  find_path(ONNXRUNTIME_INCLUDE_DIR onnxruntime_cxx_api.h
            PATHS "${ONNXRUNTIME_ROOT}/include" "${ONNXRUNTIME_ROOT}/include/onnxruntime" NO_DEFAULT_PATH)
  find_library(ONNXRUNTIME_LIBRARY onnxruntime PATHS "${ONNXRUNTIME_ROOT}/lib" "${ONNXRUNTIME_ROOT}/lib64" NO_DEFAULT_PATH)
  if(NOT ONNXRUNTIME_INCLUDE_DIR OR NOT ONNXRUNTIME_LIBRARY)
    message(FATAL_ERROR "ONNXRUNTIME_ROOT=${ONNXRUNTIME_ROOT} has no include/onnxruntime_cxx_api.h or lib/libonnxruntime")
  endif()
else()
  find_path(ONNXRUNTIME_INCLUDE_DIR onnxruntime_cxx_api.h PATHS "${_fetched_include}/onnxruntime" NO_DEFAULT_PATH)
  if(NOT ONNXRUNTIME_INCLUDE_DIR)
    message(FATAL_ERROR "ONNX Runtime headers not found in ${_fetched_include}/onnxruntime: ${_fetch_hint}")
  endif()
  # The wheel's library, found through the Python that has onnxruntime installed: the repo's .venv by default.
  if(NOT EDGEATTN_PYTHON)
    if(EXISTS "${EDGEATTN_REPO_ROOT}/.venv/bin/python")
      set(EDGEATTN_PYTHON "${EDGEATTN_REPO_ROOT}/.venv/bin/python")
    else()
      find_package(Python3 COMPONENTS Interpreter REQUIRED)
      set(EDGEATTN_PYTHON "${Python3_EXECUTABLE}")
    endif()
  endif()
  set(EDGEATTN_PYTHON "${EDGEATTN_PYTHON}" CACHE FILEPATH "The Python whose onnxruntime wheel provides libonnxruntime")
  execute_process(
    COMMAND "${EDGEATTN_PYTHON}" -c
            "import os, onnxruntime; print(os.path.join(os.path.dirname(onnxruntime.__file__), 'capi'), end='')"
    OUTPUT_VARIABLE _capi RESULT_VARIABLE _rc ERROR_QUIET)
  if(NOT _rc EQUAL 0)
    message(FATAL_ERROR "${EDGEATTN_PYTHON} cannot import onnxruntime: install it (pip install onnxruntime), "
                        "set EDGEATTN_PYTHON, or set ONNXRUNTIME_ROOT")
  endif()
  file(GLOB _wheel_libs "${_capi}/libonnxruntime.so.1.*" "${_capi}/libonnxruntime.1.*.dylib")
  if(NOT _wheel_libs)
    message(FATAL_ERROR "no libonnxruntime.so.1.* in ${_capi} (the onnxruntime wheel of ${EDGEATTN_PYTHON})")
  endif()
  list(SORT _wheel_libs)
  list(GET _wheel_libs -1 _wheel_lib)
  # The wheel ships only libonnxruntime.so.1.X.Y, while the linker wants libonnxruntime.so and the loader the
  # SONAME libonnxruntime.so.1: both as links in the build tree, which is also the executables' RPATH.
  set(_lib_dir "${CMAKE_BINARY_DIR}/onnxruntime-lib")
  file(MAKE_DIRECTORY "${_lib_dir}")
  foreach(_name libonnxruntime.so libonnxruntime.so.1)
    file(REMOVE "${_lib_dir}/${_name}")
    file(CREATE_LINK "${_wheel_lib}" "${_lib_dir}/${_name}" SYMBOLIC)
  endforeach()
  set(ONNXRUNTIME_LIBRARY "${_lib_dir}/libonnxruntime.so")
endif()

file(STRINGS "${ONNXRUNTIME_INCLUDE_DIR}/onnxruntime_c_api.h" _api REGEX "^#define ORT_API_VERSION [0-9]+")
string(REGEX REPLACE "[^0-9]" "" _api "${_api}")
get_filename_component(_ort_lib_real "${ONNXRUNTIME_LIBRARY}" REALPATH)
message(STATUS "ONNX Runtime: headers ${ONNXRUNTIME_INCLUDE_DIR} (C API ${_api}), library ${_ort_lib_real}")
if(_api LESS 23)
  message(STATUS "ONNX Runtime headers older than 1.23: memory statistics (Ort::Allocator::GetStats) unavailable")
endif()

add_library(onnxruntime::onnxruntime SHARED IMPORTED GLOBAL)
set_target_properties(onnxruntime::onnxruntime PROPERTIES
  IMPORTED_LOCATION "${ONNXRUNTIME_LIBRARY}"
  INTERFACE_INCLUDE_DIRECTORIES "${ONNXRUNTIME_INCLUDE_DIR}")
get_filename_component(ONNXRUNTIME_LIBRARY_DIR "${ONNXRUNTIME_LIBRARY}" DIRECTORY)

# ---- nlohmann/json ----------------------------------------------------------------------------------------------
find_path(NLOHMANN_JSON_INCLUDE_DIR nlohmann/json.hpp PATHS "${_fetched_include}")
if(NOT NLOHMANN_JSON_INCLUDE_DIR)
  message(FATAL_ERROR "nlohmann/json.hpp not found (system or ${_fetched_include}): ${_fetch_hint}")
endif()
add_library(edgeattn_nlohmann_json INTERFACE)
target_include_directories(edgeattn_nlohmann_json SYSTEM INTERFACE "${NLOHMANN_JSON_INCLUDE_DIR}")
