// kvtier._kvtier: the Python binding of libkvtier (kvtier::Client and the
// types it uses). The public Python API is the `kvtier` package
// (client/python/src/kvtier/__init__.py), which re-exports these names and adds the
// PyTorch helpers; its stubs are in _kvtier.pyi.
// Its parts: binding.h (converters, the GIL and error rules, the classes
// behind Client and Op), module_types.cc and module_client.cc.
//
// Rules kept here:
//   - every call that may wait on the daemon releases the GIL;
//   - every error is a kvtier.Error subclass chosen by the status code
//     (kvtier/_errors.py), raised with the C++ message;
//   - bad input (wrong types, lengths, ranges, a closed client) is an
//     exception before anything reaches the C++ client, never a crash.
//
// A Client is usable from several Python threads: the C++ client serialises
// calls on its connection, and close() waits for the calls in flight (they
// hold a reference to it).
#include "binding.h"

PYBIND11_MODULE(_kvtier, m) {
  m.doc() = "The binding of libkvtier; use the kvtier package.";
  m.attr("__version__") = kvtier::Client::release();
  kvtier::python::BindTypes(m);
  kvtier::python::BindClient(m);
}
