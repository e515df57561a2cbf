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
 *
 * Injection (a route entering the range mid-way, at local layer k): the
 * caller names `inject` = "l_out-<k-1>" and points `in` at the session's
 * incoming rows. When that node has been computed (from whatever entered
 * the first layer: the same rows, run through layers the session skips),
 * its data is overwritten with `in` + used, and the graph goes on: the
 * layers from k on see exactly the rows the route sent. One loaded model
 * serves every entry point; no second copy of a weight. ubatches arrive in
 * order, each taking its rows (`used` advances); a wrong type or too few
 * rows set used = -1 and end the graph (the caller raises).
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
    char inject[GGML_MAX_NAME];  /* node whose rows are replaced; "" : none */
    const float * in;  /* the caller's rows for it (NULL: no injection) */
    int64_t in_len;    /* floats at `in` */
    int64_t used;      /* floats injected so far; -1 on a wrong type or too few rows */
} meshd_capture;

int32_t meshd_capture_abi(void) {
    return (int32_t) sizeof(meshd_capture);
}

bool meshd_capture_eval(struct ggml_tensor * t, bool ask, void * user) {
    meshd_capture * c = (meshd_capture *) user;
    if (c->in != NULL && c->used >= 0 && strcmp(ggml_get_name(t), c->inject) == 0) {
        if (ask) {
            return true;
        }
        size_t nbytes = ggml_nbytes(t);
        if (t->type != GGML_TYPE_F32 || (int64_t) (nbytes / sizeof(float)) > c->in_len - c->used) {
            c->used = -1;
            return false;
        }
        ggml_backend_tensor_set(t, c->in + c->used, 0, nbytes);
        c->used += (int64_t) (nbytes / sizeof(float));
        return true;
    }
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
