"""Where produced files go: an ArtifactStore (a local folder or Azure Blob Storage), and the uploads of a run.

    storage   the stores: LocalStore, AzureBlobStore (read-only SAS links), chosen from the environment
    uploads   every produced file and image handed to the store; what became of each

May import: nbexec's values, notebook.links, files.
"""
