/*
 * gpu_serde stand-in CUDA driver: what it does not simulate, said by name.
 *
 * Every driver function that the other files do not define (kernels and modules: cuLibrary*,
 * cuModule*, cuLaunch*, cuFunc*; graphs and stream capture: cuGraph*, cuStreamBeginCapture*; and the
 * rest) still resolves through cuGetProcAddress, to a stub of its own that returns
 * CUDA_ERROR_STUB_LIBRARY, the driver's code for "the CUDA driver that the application has loaded is a
 * stub library". Right after such a call, cuGetErrorName in the same thread names the call:
 * "CUDA_ERROR_STUB_LIBRARY (gpu_serde simulated GPU: cuLibraryLoadData is not simulated; ...)", which
 * is the text of the CUDAError that cuda.core raises. With GPU_SERDE_SIM_TRACE=1 every such call
 * prints a line on stderr (sim_fail); otherwise the stand-in prints nothing, as a driver would: some
 * callers try a call and carry on without it.
 *
 * The CUDA runtime linked into cuda.bindings (cuda.bindings.runtime; cuda.core's Device.sync() and
 * Device.pci_bus_id) starts by asking the driver for private tables (cuGetExportTable), one of which
 * is an integrity check that only NVIDIA's driver can answer: the runtime then fails with
 * cudaErrorSoftwareValidityNotEstablished. This stand-in does not imitate that check; it answers
 * cuGetExportTable with CUDA_ERROR_STUB_LIBRARY, which the runtime reports as cudaErrorStubLibrary
 * (cuda-bindings 12.9 and 13.x alike).
 *
 * A stub is called with the real function's arguments and ignores them: its prototype takes none,
 * which the x86-64 and AArch64 calling conventions allow (the caller owns its arguments).
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "simdriver.h"

#define DOCS "help(gpu_serde.testing) says what is simulated"
#define N_STUBS 1000

struct stub { const char *name; char *label; };
static struct stub stubs[N_STUBS];
static int n_stubs;
static pthread_mutex_t stub_lock = PTHREAD_MUTEX_INITIALIZER;
/* the label of this thread's last call that is not simulated (cuGetErrorName shows it) */
static __thread const char *last_label;

static const char runtime_label[] =
    "CUDA_ERROR_STUB_LIBRARY (gpu_serde simulated GPU: cuGetExportTable, the CUDA runtime's start, "
    "is not simulated; " DOCS ")";

static CUresult not_simulated(int i) {
    last_label = stubs[i].label;
    return sim_fail(STUB_LIBRARY, stubs[i].name);
}

/* N_STUBS functions stub_1000 .. stub_1999, each knowing its own index (n - 1000). */
#define STUB(n) static CUresult stub_##n(void) { return not_simulated(n - 1000); }
#define STUB10(n) STUB(n##0) STUB(n##1) STUB(n##2) STUB(n##3) STUB(n##4) \
                  STUB(n##5) STUB(n##6) STUB(n##7) STUB(n##8) STUB(n##9)
#define STUB100(n) STUB10(n##0) STUB10(n##1) STUB10(n##2) STUB10(n##3) STUB10(n##4) \
                   STUB10(n##5) STUB10(n##6) STUB10(n##7) STUB10(n##8) STUB10(n##9)
STUB100(10) STUB100(11) STUB100(12) STUB100(13) STUB100(14)
STUB100(15) STUB100(16) STUB100(17) STUB100(18) STUB100(19)
#define FN(n) (void *)stub_##n,
#define FN10(n) FN(n##0) FN(n##1) FN(n##2) FN(n##3) FN(n##4) FN(n##5) FN(n##6) FN(n##7) FN(n##8) FN(n##9)
#define FN100(n) FN10(n##0) FN10(n##1) FN10(n##2) FN10(n##3) FN10(n##4) \
                 FN10(n##5) FN10(n##6) FN10(n##7) FN10(n##8) FN10(n##9)
static void *const stub_fns[N_STUBS] = {
    FN100(10) FN100(11) FN100(12) FN100(13) FN100(14)
    FN100(15) FN100(16) FN100(17) FN100(18) FN100(19)
};

void *sim_stub(const char *symbol) {
    if (!symbol || !*symbol) return NULL;
    void *fn = NULL;
    pthread_mutex_lock(&stub_lock);
    for (int i = 0; i < n_stubs && !fn; i++)
        if (strcmp(stubs[i].name, symbol) == 0) fn = stub_fns[i];
    if (!fn && n_stubs < N_STUBS) {
        char *name = strdup(symbol);
        char *label = NULL;
        if (name && asprintf(&label, "CUDA_ERROR_STUB_LIBRARY (gpu_serde simulated GPU: %s is not "
                             "simulated; " DOCS ")", symbol) >= 0) {
            stubs[n_stubs].name = name;
            stubs[n_stubs].label = label;
            fn = stub_fns[n_stubs++];
        } else {
            free(name);
        }
    }
    pthread_mutex_unlock(&stub_lock);
    return fn;
}

const char *sim_stub_label(void) { return last_label; }

CUresult cuGetExportTable(const void **table, const CUuuid *id) {
    (void)id;
    if (table) *table = NULL;
    last_label = runtime_label;
    return sim_fail(STUB_LIBRARY, "cuGetExportTable (the CUDA runtime's start: Device.sync(), "
                                  "Device.pci_bus_id and cuda.bindings.runtime are not simulated)");
}
