/* The limit for cachefs's own FUSE layer: a libfuse 3 low-level server that does nothing.
 *
 * benchmarks/fuse_layer.py builds it in the run (gcc, pkg-config fuse3; libfuse3-dev) and mounts it
 * single-threaded beside a cachefs mount: the daemon CPU per GETXATTR of the root (a request the kernel
 * never answers from a cache) is then the cost of a FUSE round trip through libfuse's C loop, against
 * which cachefs's per-request CPU is judged (issue 39: <= 1.5x).
 *
 * The root is an empty directory; getxattr of any name answers the two bytes "ok". Usage:
 *   fuse_null -f -s MOUNTPOINT
 */
#define FUSE_USE_VERSION 34

#include <errno.h>
#include <fuse_lowlevel.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static const double LONG_TIMEOUT_S = 3600.0;
static const char XATTR_VALUE[] = "ok";

static void root_attr(struct stat *st)
{
    memset(st, 0, sizeof(*st));
    st->st_ino = FUSE_ROOT_ID;
    st->st_mode = S_IFDIR | 0755;
    st->st_nlink = 2;
    st->st_uid = getuid();
    st->st_gid = getgid();
}

static void null_getattr(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    (void)fi;
    if (ino != FUSE_ROOT_ID) {
        fuse_reply_err(req, ENOENT);
        return;
    }
    struct stat st;
    root_attr(&st);
    fuse_reply_attr(req, &st, LONG_TIMEOUT_S);
}

static void null_lookup(fuse_req_t req, fuse_ino_t parent, const char *name)
{
    (void)parent;
    (void)name;
    fuse_reply_err(req, ENOENT);
}

static void null_getxattr(fuse_req_t req, fuse_ino_t ino, const char *name, size_t size)
{
    (void)ino;
    (void)name;
    size_t length = sizeof(XATTR_VALUE) - 1;
    if (size == 0)
        fuse_reply_xattr(req, length);
    else if (size < length)
        fuse_reply_err(req, ERANGE);
    else
        fuse_reply_buf(req, XATTR_VALUE, length);
}

static const struct fuse_lowlevel_ops null_ops = {
    .lookup = null_lookup,
    .getattr = null_getattr,
    .getxattr = null_getxattr,
};

int main(int argc, char *argv[])
{
    struct fuse_args args = FUSE_ARGS_INIT(argc, argv);
    struct fuse_cmdline_opts opts;
    int status = 1;

    if (fuse_parse_cmdline(&args, &opts) != 0)
        return 1;
    if (opts.mountpoint == NULL) {
        fprintf(stderr, "usage: %s -f -s MOUNTPOINT\n", argv[0]);
        goto free_args;
    }
    struct fuse_session *se = fuse_session_new(&args, &null_ops, sizeof(null_ops), NULL);
    if (se == NULL)
        goto free_mountpoint;
    if (fuse_set_signal_handlers(se) != 0)
        goto destroy;
    if (fuse_session_mount(se, opts.mountpoint) != 0)
        goto remove_handlers;
    fuse_daemonize(opts.foreground);
    status = fuse_session_loop(se) != 0;
    fuse_session_unmount(se);
remove_handlers:
    fuse_remove_signal_handlers(se);
destroy:
    fuse_session_destroy(se);
free_mountpoint:
    free(opts.mountpoint);
free_args:
    fuse_opt_free_args(&args);
    return status;
}
