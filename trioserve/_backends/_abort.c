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
 * ctypes.CFUNCTYPE(c_bool, c_void_p)(ABORT_CHECK_ADDRESS). EVAL_CHECK_ADDRESS: the same
 * check as a graph-evaluation callback, for libmtmd's image encode.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdbool.h>

static bool trioserve_abort_check(void *flag) {
    return __atomic_load_n((const unsigned char *)flag, __ATOMIC_RELAXED) != 0;
}

/*
 * ggml's graph-evaluation callback (mtmd_context_params.cb_eval), used as an abort
 * check for libmtmd's image encode, which has no abort callback of its own. ggml asks
 * before each node whether the caller wants to see it (`ask`): yes, so each node runs
 * as a graph of its own and is followed by a call with `ask` false, whose answer
 * false stops the rest of the graph. `user_data` holds the address of a pointer to the
 * flag byte, so the flag can be chosen after the context is made (NULL: never stop).
 */
struct ggml_tensor;

static bool trioserve_eval_check(struct ggml_tensor *tensor, bool ask, void *user_data) {
    (void)tensor;
    if (ask) {
        return true;
    }
    const unsigned char *flag = *(const unsigned char *const *)user_data;
    return flag == NULL || __atomic_load_n(flag, __ATOMIC_RELAXED) == 0;
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
    PyObject *eval = PyLong_FromVoidPtr((void *)trioserve_eval_check);
    if (eval == NULL || PyModule_AddObject(m, "EVAL_CHECK_ADDRESS", eval) < 0) {
        Py_XDECREF(eval);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
