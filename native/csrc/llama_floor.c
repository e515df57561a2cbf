/* The bare llama.cpp split floor: one slice per process, raw rows over pipes.
 *
 * No meshd, no Python, no gRPC on the path: what a llama.cpp split costs on
 * this machine by itself. `meshd bench swarm --backend llama.cpp` runs it
 * on the same slices (native/slice.py) with the same context settings and
 * threads per process as a worker, beside the daemons (native/llama_floor.py
 * starts and wires the processes).
 *
 *   head  (--prompt, --new): reads nothing but the tail's token ids on fd 0,
 *         writes its residual rows to the next process on fd 1, drives the
 *         generation and writes one JSON line to --report.
 *   other: reads  [int32 n, int32 pos, n * n_embd float32 rows]  on fd 0;
 *         a middle slice writes the same message with its rows on fd 1, the
 *         tail writes the int32 argmax of the last position's logits.
 *         n == 0 ends the process (and is passed on).
 *
 * Ring of 3: head -> middle -> tail -> head. Greedy, so the tokens must equal
 * the whole model's (the bench checks). Every count read is bounded by
 * --batch; a short read or a bad count ends the process with exit code 3.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#include "llama.h"
#include "capture.c"

#define MAX_PROMPT 4096
#define MAX_STOPS 16

static void quiet(enum ggml_log_level level, const char * text, void * user) {
    (void) user;
    if (level == GGML_LOG_LEVEL_ERROR) fputs(text, stderr);
}

static void die(const char * what) {
    fprintf(stderr, "llama_floor: %s\n", what);
    exit(3);
}

static void read_all(int fd, void * buf, size_t n) {
    char * p = buf;
    while (n > 0) {
        ssize_t r = read(fd, p, n);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) die("short read");
        p += r; n -= (size_t) r;
    }
}

static void write_all(int fd, const void * buf, size_t n) {
    const char * p = buf;
    while (n > 0) {
        ssize_t w = write(fd, p, n);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) die("short write");
        p += w; n -= (size_t) w;
    }
}

static meshd_capture cap;

/* n positions of sequence 0 from pos; the residual lands in cap.out (capture) or the logits */
static void run(struct llama_context * ctx, struct llama_batch * b, int n, int pos, int capture, int n_embd) {
    b->n_tokens = n;
    for (int j = 0; j < n; j++) {
        b->pos[j] = pos + j;
        b->n_seq_id[j] = 1;
        b->seq_id[j][0] = 0;
        b->logits[j] = (int8_t) (capture >= 0 || j == n - 1);
    }
    cap.want = capture >= 0;
    cap.got = 0;
    if (llama_decode(ctx, *b) != 0) die("llama_decode failed");
    cap.want = 0;
    if (capture >= 0 && cap.got != (int64_t) n * n_embd) die("no residual captured");
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double) ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int parse_ids(const char * s, int32_t * out, int max) {
    int n = 0;
    while (*s) {
        char * end;
        long v = strtol(s, &end, 10);
        if (end == s || n >= max) return -1;
        out[n++] = (int32_t) v;
        s = (*end == ',') ? end + 1 : end;
        if (*end && *end != ',') return -1;
    }
    return n;
}

int main(int argc, char ** argv) {
    const char * model_path = NULL, * prompt_s = NULL, * report = NULL, * stops_s = "";
    int threads = 1, n_ctx = 1024, n_embd = 0, capture = -1, n_new = 0, chunk = 128, n_batch = 512;
    for (int i = 1; i + 1 < argc; i += 2) {
        const char * k = argv[i], * v = argv[i + 1];
        if (!strcmp(k, "--model")) model_path = v;
        else if (!strcmp(k, "--threads")) threads = atoi(v);
        else if (!strcmp(k, "--ctx")) n_ctx = atoi(v);
        else if (!strcmp(k, "--embd")) n_embd = atoi(v);
        else if (!strcmp(k, "--capture")) capture = atoi(v);
        else if (!strcmp(k, "--prompt")) prompt_s = v;
        else if (!strcmp(k, "--new")) n_new = atoi(v);
        else if (!strcmp(k, "--chunk")) chunk = atoi(v);
        else if (!strcmp(k, "--batch")) n_batch = atoi(v);
        else if (!strcmp(k, "--stops")) stops_s = v;
        else if (!strcmp(k, "--report")) report = v;
        else die("unknown option");
    }
    if (!model_path || n_embd <= 0 || threads < 1 || n_batch < 1 || chunk < 1 || chunk > n_batch) die("bad options");
    int head = prompt_s != NULL;
    if (head && (capture < 0 || n_new < 1 || !report)) die("the head needs --capture, --new and --report");

    llama_log_set(quiet, NULL);
    llama_backend_init();
    struct llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    struct llama_model * model = llama_model_load_from_file(model_path, mp);
    if (!model) die("cannot load the model");
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));

    float * rows = malloc(sizeof(float) * (size_t) n_batch * n_embd);
    if (!rows) die("out of memory");
    cap.out = rows; cap.cap = (int64_t) n_batch * n_embd; cap.stop = 1;
    if (capture >= 0) snprintf(cap.target, sizeof cap.target, "l_out-%d", capture);

    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = n_ctx; cp.n_batch = n_batch; cp.n_ubatch = n_batch; cp.n_seq_max = 1;
    cp.n_threads = threads; cp.n_threads_batch = threads;
    cp.kv_unified = true; cp.no_perf = true;
    cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_ENABLED;
    if (capture >= 0) { cp.cb_eval = meshd_capture_eval; cp.cb_eval_user_data = &cap; }
    struct llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) die("cannot create a context");
    struct llama_batch tok = llama_batch_init(n_batch, 0, 1);
    struct llama_batch emb = llama_batch_init(n_batch, n_embd, 1);


    if (!head) {
        for (;;) {
            int32_t hdr[2];
            read_all(0, hdr, sizeof hdr);
            if (hdr[0] == 0) { if (capture >= 0) write_all(1, hdr, sizeof hdr); break; }
            if (hdr[0] < 0 || hdr[0] > n_batch || hdr[1] < 0 || hdr[1] + hdr[0] > n_ctx) die("bad message header");
            int n = hdr[0];
            read_all(0, emb.embd, sizeof(float) * (size_t) n * n_embd);
            run(ctx, &emb, n, hdr[1], capture, n_embd);
            if (capture >= 0) {
                write_all(1, hdr, sizeof hdr);
                write_all(1, rows, sizeof(float) * (size_t) n * n_embd);
            } else {
                const float * logits = llama_get_logits_ith(ctx, n - 1);
                if (!logits) die("no logits");
                int32_t best = 0;
                for (int v = 1; v < n_vocab; v++) if (logits[v] > logits[best]) best = v;
                write_all(1, &best, sizeof best);
            }
        }
        return 0;
    }

    static int32_t prompt[MAX_PROMPT], stops[MAX_STOPS];
    int n_prompt = parse_ids(prompt_s, prompt, MAX_PROMPT);
    int n_stops = *stops_s ? parse_ids(stops_s, stops, MAX_STOPS) : 0;
    if (n_prompt < 1 || n_stops < 0 || n_prompt + n_new > n_ctx) die("bad --prompt or --stops");
    int32_t * out = malloc(sizeof(int32_t) * (size_t) n_new);
    if (!out) die("out of memory");
    int n_out = 0;
    int32_t next = 0;
    double t0 = now_s(), t1 = 0;
    for (int first = 0; first < n_prompt; first += chunk) {
        int n = n_prompt - first < chunk ? n_prompt - first : chunk;
        for (int j = 0; j < n; j++) tok.token[j] = prompt[first + j];
        run(ctx, &tok, n, first, capture, n_embd);
        int32_t hdr[2] = {n, first};
        write_all(1, hdr, sizeof hdr);
        write_all(1, rows, sizeof(float) * (size_t) n * n_embd);
        read_all(0, &next, sizeof next);
    }
    out[n_out++] = next;
    double prefill_s = now_s() - t0;
    t1 = now_s();
    for (;;) {
        int stop = 0;
        for (int s = 0; s < n_stops; s++) stop |= next == stops[s];
        if (stop || n_out >= n_new) break;
        tok.token[0] = next;
        run(ctx, &tok, 1, n_prompt + n_out - 1, capture, n_embd);
        int32_t hdr[2] = {1, n_prompt + n_out - 1};
        write_all(1, hdr, sizeof hdr);
        write_all(1, rows, sizeof(float) * (size_t) n_embd);
        read_all(0, &next, sizeof next);
        out[n_out++] = next;
    }
    double decode_s = now_s() - t1;
    int32_t bye[2] = {0, 0};
    write_all(1, bye, sizeof bye);
    FILE * f = fopen(report, "w");
    if (!f) die("cannot write the report");
    fprintf(f, "{\"prefill_s\": %.6f, \"decode_s\": %.6f, \"tokens\": [", prefill_s, decode_s);
    for (int i = 0; i < n_out; i++) fprintf(f, "%s%d", i ? ", " : "", out[i]);
    fprintf(f, "]}\n");
    fclose(f);
    return 0;
}
