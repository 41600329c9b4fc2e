/* The limit for cachefs's own FUSE layer: a libfuse 3 low-level server that does nothing.
 *
 * benchmarks/fuse_layer.py builds it in the run (gcc, pkg-config fuse3; libfuse3-dev) and mounts it
 * single-threaded beside a cachefs mount: the daemon CPU per GETXATTR of the root (a request the kernel
 * never answers from a cache) is then the cost of a FUSE round trip through libfuse's C loop, against
 * which cachefs's per-request CPU is judged (issue 39: <= 1.5x).
 *
 * The root holds FUSE_NULL_FILES files (an environment variable, default 0) named f00000, f00001, ...
 * of FUSE_NULL_SIZE bytes each (default 102400, all zeros): opened with keep_cache and noflush, the
 * way cachefs opens a file on a writable mount, so a warm re-read of one costs an OPEN and a RELEASE
 * here too (the limit beside cachefs's warm-file figure). getxattr of any name answers the two bytes
 * "ok". Usage:
 *   FUSE_NULL_FILES=2000 fuse_null -f -s MOUNTPOINT
 */
#define FUSE_USE_VERSION 34

#include <errno.h>
#include <fcntl.h>
#include <fuse_lowlevel.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static const double LONG_TIMEOUT_S = 3600.0;
static const char XATTR_VALUE[] = "ok";

static unsigned long files;     /* inodes 2 .. files + 1 */
static size_t file_size = 102400;
static char *zeros;             /* file_size bytes: every file's content */

static int file_attr(fuse_ino_t ino, struct stat *st)
{
    if (ino < 2 || ino >= 2 + files)
        return 0;
    memset(st, 0, sizeof(*st));
    st->st_ino = ino;
    st->st_mode = S_IFREG | 0644;
    st->st_nlink = 1;
    st->st_size = (off_t)file_size;
    st->st_uid = getuid();
    st->st_gid = getgid();
    return 1;
}

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
    struct stat st;
    if (ino == FUSE_ROOT_ID)
        root_attr(&st);
    else if (!file_attr(ino, &st)) {
        fuse_reply_err(req, ENOENT);
        return;
    }
    fuse_reply_attr(req, &st, LONG_TIMEOUT_S);
}

static void null_lookup(fuse_req_t req, fuse_ino_t parent, const char *name)
{
    char *end;
    unsigned long n;
    struct fuse_entry_param e;
    if (parent != FUSE_ROOT_ID || name[0] != 'f' || name[1] == '\0') {
        fuse_reply_err(req, ENOENT);
        return;
    }
    n = strtoul(name + 1, &end, 10);
    memset(&e, 0, sizeof(e));
    if (*end != '\0' || !file_attr(2 + n, &e.attr)) {
        fuse_reply_err(req, ENOENT);
        return;
    }
    e.ino = 2 + n;
    e.attr_timeout = LONG_TIMEOUT_S;
    e.entry_timeout = LONG_TIMEOUT_S;
    fuse_reply_entry(req, &e);
}

static void null_open(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    struct stat st;
    if (!file_attr(ino, &st)) {
        fuse_reply_err(req, ENOENT);
        return;
    }
    if ((fi->flags & O_ACCMODE) != O_RDONLY) {
        fuse_reply_err(req, EACCES);
        return;
    }
    fi->keep_cache = 1;
    fi->noflush = 1;
    fuse_reply_open(req, fi);
}

static void null_read(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off, struct fuse_file_info *fi)
{
    (void)ino;
    (void)fi;
    if ((size_t)off >= file_size)
        size = 0;
    else if (size > file_size - (size_t)off)
        size = file_size - (size_t)off;
    fuse_reply_buf(req, zeros, size);
}

static void null_release(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    (void)ino;
    (void)fi;
    fuse_reply_err(req, 0);
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
    .open = null_open,
    .read = null_read,
    .release = null_release,
};

int main(int argc, char *argv[])
{
    struct fuse_args args = FUSE_ARGS_INIT(argc, argv);
    struct fuse_cmdline_opts opts;
    int status = 1;
    const char *count = getenv("FUSE_NULL_FILES"), *size = getenv("FUSE_NULL_SIZE");

    if (count != NULL)
        files = strtoul(count, NULL, 10);
    if (size != NULL)
        file_size = strtoul(size, NULL, 10);
    zeros = calloc(1, file_size + 1);
    if (zeros == NULL)
        return 1;

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
