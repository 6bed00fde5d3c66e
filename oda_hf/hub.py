"""Publishing ODA heads: upload exactly what `save_pretrained` wrote, generated model card included.

transformers' `push_to_hub` replaces README.md with a card loaded from (or created for) the hub repo;
ODA's card carries the head's provenance and scores, so it must be the one uploaded. An upload is one commit that
also clears what an older save left on the repo and a loader would read beside the new weights: weight files the new
save does not write, and a calibration measured on other weights (calibration.json, and its threshold in
oda_config.json), as `RecallHead.save_pretrained` does in a local folder.
"""

from __future__ import annotations

import fnmatch
import os
import tempfile

from transformers.utils import logging

logger = logging.get_logger(__name__)


def push_saved_to_hub(obj, repo_id: str, *, commit_message: str | None = None, private: bool | None = None,
                      token: bool | str | None = None, revision: str | None = None, create_pr: bool = False,
                      commit_description: str | None = None, **save_kwargs):
    """Create `repo_id` if needed, `obj.save_pretrained` into a temporary folder and upload all of it."""
    from transformers.utils.hub import hf_api

    repo_id = hf_api().create_repo(repo_id, private=private, token=token, exist_ok=True).repo_id
    with tempfile.TemporaryDirectory() as folder:
        obj.save_pretrained(folder, **save_kwargs)
        return upload_saved_files(folder, sorted(os.listdir(folder)), repo_id, commit_message=commit_message,
                                  token=token, create_pr=create_pr, revision=revision,
                                  commit_description=commit_description)


def upload_saved_files(folder, names, repo_id: str, *, commit_message: str | None = None, token=None,
                       create_pr: bool = False, revision: str | None = None, commit_description: str | None = None):
    """Upload the files `names` of `folder` (a head's save) to `repo_id` in one commit that also deletes what an older
    save left there for a loader to read beside them (`_stale_files_on_hub`)."""
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete
    from huggingface_hub.errors import HfHubHTTPError
    from transformers.utils.hub import hf_api

    api = hf_api()
    if revision is not None and not revision.startswith("refs/pr"):  # as transformers' push_to_hub does
        try:
            api.create_branch(repo_id=repo_id, branch=revision, token=token, exist_ok=True)
        except HfHubHTTPError as err:
            if not (create_pr and err.response is not None and err.response.status_code == 403):
                raise
    with tempfile.TemporaryDirectory() as scratch:
        delete, replace = _stale_files_on_hub(api, folder, names, repo_id, revision, token, scratch)
        operations = [CommitOperationAdd(path_or_fileobj=os.path.join(folder, name), path_in_repo=name)
                      for name in names if name not in replace]
        operations += [CommitOperationAdd(path_or_fileobj=path, path_in_repo=name) for name, path in replace.items()]
        operations += [CommitOperationDelete(path_in_repo=name) for name in delete]
        return api.create_commit(repo_id=repo_id, operations=operations,
                                 commit_message=commit_message or "Upload ODA recall head",
                                 commit_description=commit_description, token=token, create_pr=create_pr,
                                 revision=revision)


def _stale_files_on_hub(api, folder, names, repo_id, revision, token, scratch) -> tuple[list[str], dict[str, str]]:
    """``(files to delete, {file: replacement path})`` on the repo for an upload of `names` from `folder`.

    Deleted: weight files of an older save the upload does not write (shards, an index, pytorch weights), and a
    calibration.json measured on other weights (its model.safetensors differs from the one uploaded). That
    calibration's threshold lives in the repo's oda_config.json, which goes back to the default threshold (replaced by
    a copy), as `uncalibrated_routing` does locally: left there, or uploaded again by a model loaded from the repo, the
    next load by id would route the new weights with the old weights' threshold. An uploaded oda_config.json with another
    threshold is the caller's choice and goes up as it is."""
    from huggingface_hub.errors import EntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError
    from huggingface_hub.hf_api import RepoFile

    from .config import CALIBRATION_NAME, ODA_CONFIG_NAME, OdaConfig
    from .head import HEAD_WEIGHT_FILES

    try:
        on_hub = {entry.path: entry for entry in api.list_repo_tree(repo_id, revision=revision, token=token)
                  if isinstance(entry, RepoFile)}
    except (RepositoryNotFoundError, RevisionNotFoundError, EntryNotFoundError):
        return [], {}   # nothing there yet
    names = set(names)
    delete = [path for path in on_hub if path not in names
              and any(fnmatch.fnmatch(path, pattern) for pattern in HEAD_WEIGHT_FILES)]
    replace: dict[str, str] = {}
    if CALIBRATION_NAME in on_hub and CALIBRATION_NAME not in names \
            and _hub_sha256(on_hub.get(SAFE_WEIGHTS)) != _local_sha256(os.path.join(folder, SAFE_WEIGHTS)):
        delete.append(CALIBRATION_NAME)
        if ODA_CONFIG_NAME in on_hub:
            saved = api.hf_hub_download(repo_id, ODA_CONFIG_NAME, revision=revision, token=token)
            try:
                calibrated = OdaConfig.from_json_file(saved)
            except (OSError, ValueError):   # unreadable: gone rather than left with the old threshold
                calibrated = None
                if ODA_CONFIG_NAME not in names:
                    delete.append(ODA_CONFIG_NAME)
            # The upload's own routing is the caller's, unless its threshold is the calibrated one (a model loaded
            # from this repo and given new weights), which goes back to the default as `uncalibrated_routing` does.
            uploaded = OdaConfig.from_json_file(os.path.join(folder, ODA_CONFIG_NAME)) \
                if ODA_CONFIG_NAME in names else calibrated
            if calibrated is not None and uploaded.threshold == calibrated.threshold:
                OdaConfig.from_kwargs(uploaded, threshold=OdaConfig().threshold).save_pretrained(scratch)
                replace[ODA_CONFIG_NAME] = os.path.join(scratch, ODA_CONFIG_NAME)
        logger.warning(f"{repo_id} held a calibration of other weights: {CALIBRATION_NAME} is deleted with this upload"
                       + (f" and {ODA_CONFIG_NAME}'s threshold goes back to the default" if replace
                          else f" with its unreadable {ODA_CONFIG_NAME}" if ODA_CONFIG_NAME in delete else "")
                       + "; run `oda calibrate` on the new weights and upload its result.")
    return sorted(delete), replace


#: The one weight file a saved head has (`RecallHead.save_files`).
SAFE_WEIGHTS = "model.safetensors"


def _hub_sha256(entry) -> str | None:
    """SHA-256 of a repo file stored with LFS (weights are), else None."""
    lfs = getattr(entry, "lfs", None)
    return getattr(lfs, "sha256", None) if lfs is not None else None


def _local_sha256(path: str) -> str | None:
    from .known_models import file_sha256

    return file_sha256(path) if os.path.isfile(path) else None
