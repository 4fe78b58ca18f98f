"""Where produced files go: an ArtifactStore (a local folder, Azure Blob Storage, S3 or Google Cloud Storage), and
the uploads of a run.

    storage   the protocol, LocalStore, AzureBlobStore (read-only SAS links); from_env picks a store
    s3        S3Store: an S3-compatible bucket, presigned GET links, multipart uploads
    gcs       GCSStore: a GCS bucket, V4 signed GET links, resumable uploads
    serving   what the uploading stores share: the attachment rule, safe types, link lifetimes, redaction
    uploads   every produced file and image handed to the store; what became of each

May import: nbexec's values, notebook.links, files.
"""
