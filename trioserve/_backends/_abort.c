/*
 * llama.cpp's abort callback, in C.
 *
 * ggml calls the abort callback between graph nodes: ~400 times per decode step of a
 * small model, and throughout prompt processing. A Python callback must take the GIL
 * on every call, which costs CPU and, worse, stalls the decode whenever the event loop
 * holds the GIL. This callback only reads one byte: the request's abort flag, which
 * trioserve raises from a Trio task the moment the request's cancel scope is cancelled.
 *
 * The module exports the function's address; Python wraps it with
 * ctypes.CFUNCTYPE(c_bool, c_void_p)(ABORT_CHECK_ADDRESS).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdbool.h>

static bool trioserve_abort_check(void *flag) {
    return __atomic_load_n((const unsigned char *)flag, __ATOMIC_RELAXED) != 0;
}

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_abort",
    "The address of a C abort callback for llama.cpp that reads a one-byte flag.", -1, NULL,
};

PyMODINIT_FUNC PyInit__abort(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) {
        return NULL;
    }
    PyObject *address = PyLong_FromVoidPtr((void *)trioserve_abort_check);
    if (address == NULL || PyModule_AddObject(m, "ABORT_CHECK_ADDRESS", address) < 0) {
        Py_XDECREF(address);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
