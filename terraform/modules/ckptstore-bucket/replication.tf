# Optional cross-region replication of the run prefix, so that a job can resume in another
# region. S3 replicates objects asynchronously and in no particular order; see the README for
# what that means for a resume from the replica.

locals {
  replicate          = var.replication != null
  destination_region = local.replicate ? split(":", var.replication.destination_kms_key_arn)[3] : null
}

data "aws_iam_policy_document" "replication_assume" {
  count = local.replicate ? 1 : 0

  statement {
    actions = ["sts:AssumeRole"]

    principals {
      type        = "Service"
      identifiers = ["s3.amazonaws.com"]
    }

    condition {
      test     = "StringEquals"
      variable = "aws:SourceAccount"
      values   = [data.aws_caller_identity.current.account_id]
    }
  }
}

resource "aws_iam_role" "replication" {
  count              = local.replicate ? 1 : 0
  name               = "${substr(local.iam_name, 0, 52)}-replication" # role names: 64 at most
  assume_role_policy = data.aws_iam_policy_document.replication_assume[0].json
  tags               = var.tags
}

data "aws_iam_policy_document" "replication" {
  count = local.replicate ? 1 : 0

  statement {
    sid       = "ReadReplicationConfiguration"
    actions   = ["s3:GetReplicationConfiguration", "s3:ListBucket"]
    resources = [aws_s3_bucket.this.arn]
  }

  statement {
    sid = "ReadSourceVersions"
    actions = [
      "s3:GetObjectVersionAcl",
      "s3:GetObjectVersionForReplication",
      "s3:GetObjectVersionTagging",
    ]
    resources = [local.objects_arn]
  }

  statement {
    sid = "WriteReplicas"
    actions = [
      "s3:ReplicateDelete",
      "s3:ReplicateObject",
      "s3:ReplicateTags",
    ]
    resources = ["${var.replication.destination_bucket_arn}/${var.run_prefix}/*"]
  }

  statement {
    sid       = "DecryptSource"
    actions   = ["kms:Decrypt"]
    resources = [aws_kms_key.this.arn]

    condition {
      test     = "StringEquals"
      variable = "kms:ViaService"
      values   = [local.s3_service]
    }
  }

  statement {
    sid       = "EncryptReplicas"
    actions   = ["kms:Encrypt", "kms:GenerateDataKey"]
    resources = [var.replication.destination_kms_key_arn]

    condition {
      test     = "StringEquals"
      variable = "kms:ViaService"
      values   = ["s3.${local.destination_region}.${data.aws_partition.current.dns_suffix}"]
    }
  }
}

resource "aws_iam_role_policy" "replication" {
  count  = local.replicate ? 1 : 0
  name   = "replicate-run-prefix"
  role   = aws_iam_role.replication[0].id
  policy = data.aws_iam_policy_document.replication[0].json
}

resource "aws_s3_bucket_replication_configuration" "this" {
  count  = local.replicate ? 1 : 0
  bucket = aws_s3_bucket.this.id
  role   = aws_iam_role.replication[0].arn

  rule {
    id     = "resume-in-another-region"
    status = "Enabled"

    filter {
      prefix = "${var.run_prefix}/"
    }

    # Replicated delete markers make the replica follow ckptstore's retention; without them
    # the replica keeps every step ever written (until its own lifecycle rules act).
    delete_marker_replication {
      status = var.replication.replicate_delete_markers ? "Enabled" : "Disabled"
    }

    source_selection_criteria {
      sse_kms_encrypted_objects {
        status = "Enabled"
      }
    }

    destination {
      bucket        = var.replication.destination_bucket_arn
      storage_class = var.replication.storage_class

      encryption_configuration {
        replica_kms_key_id = var.replication.destination_kms_key_arn
      }

      # Replication Time Control: 99.99% of objects within 15 minutes, with metrics (extra cost).
      dynamic "replication_time" {
        for_each = var.replication.replication_time_control ? [1] : []

        content {
          status = "Enabled"
          time {
            minutes = 15
          }
        }
      }

      dynamic "metrics" {
        for_each = var.replication.replication_time_control ? [1] : []

        content {
          status = "Enabled"
          event_threshold {
            minutes = 15
          }
        }
      }
    }
  }

  lifecycle {
    precondition {
      condition     = var.versioning_enabled
      error_message = "Cross-region replication needs versioning: set versioning_enabled = true (and on the destination bucket too)."
    }
  }

  depends_on = [aws_s3_bucket_versioning.this]
}
