// Prefill attention on CPU (filled in by the native-precision work).
#include <torch/extension.h>

void register_prefill_attention(pybind11::module& m) { (void)m; }
