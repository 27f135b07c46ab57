package io.sequin.spark;

import org.apache.hadoop.conf.Configuration;
import org.apache.hadoop.fs.Path;
import org.apache.spark.sql.execution.streaming.checkpointing.FileSystemBasedCheckpointFileManager;

/**
 * Spark's FileSystem-based checkpoint file manager over NioLocalFileSystem: the same files, renames
 * and semantics for a local checkpoint, without a chmod process per file written.
 *
 * <p>Set as spark.sql.streaming.checkpointFileManagerClass by the local stream app
 * (sequin_provider/spark/checkpoint_jar.py); only this manager's file system changes, not the
 * session's.
 */
public class LocalCheckpointFileManager extends FileSystemBasedCheckpointFileManager {
  public LocalCheckpointFileManager(Path path, Configuration hadoopConf) {
    super(path, withNioLocal(hadoopConf));
  }

  private static Configuration withNioLocal(Configuration hadoopConf) {
    Configuration conf = new Configuration(hadoopConf);
    conf.set("fs.file.impl", NioLocalFileSystem.class.getName());
    conf.setBoolean("fs.file.impl.disable.cache", true); // not the cached, session-wide instance
    return conf;
  }
}
