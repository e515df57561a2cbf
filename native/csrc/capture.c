/* meshd's llama.cpp residual capture: the scheduler eval callback in C.
 *
 * llama.cpp calls the eval callback (cb_eval) for every node of the graph
 * (~470 per decode step on a 15-block SmolLM2 slice) to ask whether the
 * caller wants that node's data. Done in Python through ctypes that cost
 * about a millisecond per step; here it is a string compare.
 *
 * State: one meshd_capture per llama_context, owned by native/llama_engine.py
 * (a ctypes Structure with the same layout) and passed as cb_eval_user_data.
 * The caller arms it (want=1, got=0) before llama_decode and reads `got`
 * floats from `out` after it. A node named `target` that is F32 and fits is
 * copied at out + got (llama.cpp may run one batch as several ubatches);
 * anything else sets got = -1 (the caller raises). After the copy the
 * callback returns !stop: 0 ends the graph there, so the output norm and the
 * vocabulary projection of a non-tail slice are never computed.
 */
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#include "ggml.h"
#include "ggml-backend.h"

typedef struct meshd_capture {
    char target[GGML_MAX_NAME];
    int32_t want;      /* 0: observe nothing, never stop */
    int32_t stop;      /* 1: stop the graph after the captured node */
    float * out;       /* caller's buffer of cap floats */
    int64_t cap;
    int64_t got;       /* floats written; -1 on a wrong type or overflow */
} meshd_capture;

int32_t meshd_capture_abi(void) {
    return (int32_t) sizeof(meshd_capture);
}

bool meshd_capture_eval(struct ggml_tensor * t, bool ask, void * user) {
    meshd_capture * c = (meshd_capture *) user;
    if (!c->want || c->got < 0 || strcmp(ggml_get_name(t), c->target) != 0) {
        return !ask;
    }
    if (ask) {
        return true;
    }
    size_t nbytes = ggml_nbytes(t);
    if (t->type != GGML_TYPE_F32 || (int64_t) (nbytes / sizeof(float)) > c->cap - c->got) {
        c->got = -1;
        return false;
    }
    ggml_backend_tensor_get(t, c->out + c->got, 0, nbytes);
    c->got += (int64_t) (nbytes / sizeof(float));
    return !c->stop;
}
